"""Secured leaf links (docs/design.md §12, §13): the leaf-node identity of each island datacenter and the
permissions on both ends of its link. Pure; services/auth.py renders and writes them.

`yeto auth init --datacenters dc1,dc2` issues one nkey identity per datacenter, `leaf-<dc>` (role `leaf`:
a plain nkey user with `allowed_connection_types: [LEAFNODE]`, so the key opens no client session; the
leafnode `authorization { users }` block takes only user/password, while a leaf connecting to a listener
without it is checked against the server's users, which hold nkeys and permissions).
Invariants, two servers enforcing what crosses a link: the hub lets through only what the run's islands
may do on the hub (in its domain) plus what the datacenter's mirrors of the cut need, and sends back only
the islands' own inboxes and the mirrors' traffic (`link_permissions`, written from the leaf's side as
nats-server reads it); no syncer, observer or admin subject crosses. The leaf serves the run's islands
with their own keys and the hub's permissions moved into the domains an island behind a leaf uses
(`served_permissions`), so an island is refused at its leaf first; the admin is served in the
datacenter's domain only, syncer and observer keys not at all.
"""
from __future__ import annotations

import re

from yeto.schemas import subjects as S

LEAF_PREFIX = "leaf-"     # identity name of datacenter D: leaf-D (creds file DIR/leaf-D.creds)
ROLE = "leaf"
HUB_DOMAIN = "hub"        # the hub's JetStream domain the islands behind a leaf reach ($JS.hub.API)
_DOMAIN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
API = S.js_api()
CUT_KINDS = ("BCAST", "FINAL")   # the streams a datacenter mirrors (schemas/stream_configs.py CUT_KINDS)


def leaf_name(datacenter: str) -> str:
    """The identity (and creds file stem) of datacenter `datacenter`'s leaf node."""
    return LEAF_PREFIX + datacenter


def parse_datacenters(text: str | None, error=ValueError) -> list[str]:
    """`--datacenters dc1,dc2` -> names; each is the datacenter's JetStream domain (a subject token)."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    for n in names:
        if not _DOMAIN_RE.match(n):
            raise error(f"--datacenters: {n!r} is not a datacenter name: it becomes the leaf's JetStream domain, "
                        f"1-64 letters, digits, '_' or '-'")
        if n == HUB_DOMAIN:
            raise error(f"--datacenters: {n!r} is the hub's JetStream domain; name the datacenter otherwise")
    if len(set(names)) != len(names):
        raise error(f"--datacenters: repeated datacenter in {text!r}")
    return names


def in_domain(subject: str, domain: str | None) -> str:
    """A JetStream API subject (`$JS.API.X`) as sent to domain `domain` (`$JS.<domain>.API.X`; None:
    unchanged); other subjects (plain publishes, acks, flow control, inboxes) are the same in every domain."""
    if domain is not None and (subject == API or subject.startswith(API + ".")):
        return f"$JS.{domain}.API" + subject[len(API):]
    return subject


def _mirror_local(run: str) -> list[str]:
    """What an island does with its datacenter's mirrors of the cut (schemas.provision.ensure_cut_mirrors,
    ordered consumers and chunk reads). Sent to `$JS.<dc>.API`, checked as `$JS.API` (see LOCAL)."""
    out = []
    for kind in CUT_KINDS:
        s = S.stream(run, kind)
        out += [f"{API}.STREAM.CREATE.{s}", f"{API}.STREAM.INFO.{s}", f"{API}.STREAM.MSG.GET.{s}",
                f"{API}.DIRECT.GET.{s}", f"{API}.DIRECT.GET.{s}.>", f"{API}.CONSUMER.CREATE.{s}"]
    return out


# A server maps its own domain's API (`$JS.<own domain>.API.X`) to `$JS.API.X` before it checks a
# publish against the permissions (nats-server parser.go: mappings, then processInboundClientMsg /
# processInboundLeafMsg). So a request an island sends to its datacenter's domain is checked on the leaf
# as `$JS.API.X`, and a request to the hub's domain crossing the link is checked on the hub as
# `$JS.API.X` too; on the leaf the latter is still `$JS.hub.API.X`. LOCAL (None) keeps `$JS.API.X`.
LOCAL = None


def _moved(perms: dict, allow_domains: tuple, deny_domains: tuple) -> dict:
    """`perms` (as services.auth.permissions builds them for the hub) with every JetStream API subject
    moved into the domains given (LOCAL: unchanged): allows into `allow_domains`, denies into every one
    of `deny_domains`."""
    def move(subjects, domains):
        out = []
        for x in subjects:
            for d in domains:
                y = in_domain(x, d)
                if y not in out:
                    out.append(y)
        return out

    pub = perms["publish"]
    out = {"publish": {"allow": move(pub["allow"], allow_domains)}, "subscribe": perms["subscribe"]}
    if pub.get("deny"):
        out["publish"]["deny"] = move(pub["deny"], deny_domains)
    return out


def served_permissions(hub_perms: dict, role: str, run: str, datacenter: str) -> dict:
    """The permissions the leaf node of `datacenter` serves an identity with, from the ones the hub
    serves it with (`hub_perms`). An island: the hub's streams through the hub's domain, plus its
    datacenter's mirrors of the cut in the leaf's own JetStream; the denies hold in both. The admin:
    its provisioning rights on the leaf's own JetStream only (the mirrors live there)."""
    if role == "island":
        p = _moved(hub_perms, (HUB_DOMAIN,), (HUB_DOMAIN, LOCAL))
        p["publish"]["allow"] += _mirror_local(run)
        return p
    if role == "admin":
        return _moved(hub_perms, (LOCAL,), (HUB_DOMAIN, LOCAL))
    raise ValueError(f"role {role!r} is not served by a leaf node of {datacenter} (islands and the admin are)")


def _interest_safe(subject: str) -> str:
    """`a.b.*` -> `a.b.>` for a plain subject. The hub offers the leaf its subscriptions (a stream's
    `yeto.R.push.*.*`) only where the leaf may publish, testing a wildcard subscription against the
    allow list with Sublist.ReverseMatch, which finds no `*` entry under a `*` token (nats-server 2.15:
    `push.b.*` never matches `push.*.*`; measured: island b's pushes got "no responders"). A trailing
    `>` is found; the extra depth it allows matches no stream of the run."""
    if subject.endswith(".*") and not subject.startswith("$"):
        return subject[:-1] + ">"
    return subject


def link_permissions(run: str, islands: list[tuple[str, dict]]) -> dict:
    """The hub's permissions of a leaf identity, given each island's (public key, hub permissions).
    nats-server reads a leaf user's permissions from the leaf's side (leafnode.go reverses them on the
    hub): `publish` is what the leaf may send into the hub — the union of the islands' publishes to the
    hub, in the hub's domain (`$JS.hub.API...`), and the mirrors' sourcing (their consumer on the hub, its
    flow control) — and `subscribe` what the hub may send to it: the islands' own inboxes (`_INBOX_<key>.>`),
    the mirrors' deliveries (`$JS.M.*`) and the replies to the mirrors' requests (`$JSC.R.*`). Each JetStream
    API subject is listed as sent (`$JS.hub.API.X`: what the hub offers the leaf interest in) and as
    checked on arrival (`$JS.API.X`, see LOCAL)."""
    both = (HUB_DOMAIN, LOCAL)
    pub: list[str] = []
    deny: list[str] | None = None
    sub: list[str] = []
    for _key, perms in islands:
        moved = _moved(perms, both, both)
        pub += [x for x in map(_interest_safe, moved["publish"]["allow"]) if x not in pub]
        # Only a deny every island has may hold for the link (one island's deny is another's allow,
        # e.g. the INIT subject): the leaf enforces each island's own.
        d = moved["publish"].get("deny", [])
        deny = list(d) if deny is None else [x for x in deny if x in d]
        sub += [x for x in perms["subscribe"]["allow"] if x not in sub]
    for kind in CUT_KINDS:
        s = S.stream(run, kind)
        # the mirror's consumer on the hub: created (CONSUMER.CREATE.<s>, already an island's ordered
        # read), deleted when the mirror goes or restarts, and its flow-control replies
        for x in [in_domain(f"{API}.CONSUMER.DELETE.{s}.*", d) for d in both] + [S.js_flow_control(s)]:
            if x not in pub:
                pub.append(x)
    # Deliveries to the mirrors' consumers ($JS.M.<id>) and the answers to their consumer creates
    # ($JSC.R.<id>): the ids are random, one token.
    sub += ["$JS.M.*", "$JSC.R.*"]
    out = {"publish": {"allow": pub}, "subscribe": {"allow": sub}}
    if deny:
        out["publish"]["deny"] = deny
    return out
