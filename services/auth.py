"""Identities and server-enforced permissions of a secured run (docs/design.md §13).

Owns `yeto auth init` (`init_auth`: the files it writes into DIR are listed there) and the permissions
of every role (`permissions`: the JetStream API subjects they allow, and why, are listed there). May
touch: DIR only (private files mode 0600); the server only ever sees public keys.
Invariants: permissions are built from the same `schemas.subjects` functions the processes publish with
and from the JetStream API subjects nats-py really sends, so what a role may do is what its process does;
an island can neither create, read from, ack on, inspect nor delete another island's consumers, nor make
one of its own that reads another's messages, and has no message read on CTL at all; a second
`yeto auth init` on DIR adds islands and keeps every existing key valid; no `no_auth_user`: a connection
without a key is refused.
"""
from __future__ import annotations

import datetime as _dt
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

from yeto.schemas import subjects as S
from yeto.schemas.conn import nkey_inbox_prefix
from yeto.schemas.leader_watch import run_advisories
from yeto.schemas.ids import check_island, check_run
from yeto.services.leaf_auth import (LEAF_PREFIX, ROLE as LEAF_ROLE, leaf_name, link_permissions, parse_datacenters,
                                served_permissions)

ROLES = ("syncer", "island", "observer", "admin")
RESERVED = ("syncer", "observer", "admin")  # identity names an island may not take
API = S.js_api()
IDENTITIES_FILE = "identities.json"
AUTH_CONF = "auth.conf"
SERVER_CONF = "server.conf"
TLS_DIR = "tls"
DEFAULT_HOSTS = ("localhost", "127.0.0.1")

# What the server cannot tell apart today, said once so the README and the report quote the same text.
KNOWN_GAPS: tuple[str, ...] = ()


class AuthError(ValueError):
    """Bad input to `yeto auth init` (names the field and the value)."""


# ---- permissions (pure) -------------------------------------------------------------------------

def _streams(run: str) -> dict[str, str]:
    out = {k: S.stream(run, k) for k in S.STREAM_KINDS}
    out.update({f"kv_{k}": f"KV_{S.kv_bucket(run, k)}" for k in S.KV_KINDS})
    return out


def _read_stream(s: str, *, consumers: bool = True) -> list[str]:
    """Read-only access to stream `s`: info, message get, direct get, and (optionally) ephemeral /
    ordered consumers (create, flow control replies)."""
    out = [f"{API}.STREAM.INFO.{s}", f"{API}.STREAM.MSG.GET.{s}", f"{API}.DIRECT.GET.{s}", f"{API}.DIRECT.GET.{s}.>"]
    if consumers:
        # Ordered consumers only: nats-py 2.16 creates them unnamed with CONSUMER.CREATE.<stream>, an
        # endpoint the server refuses a durable on, so a reader cannot leave consumers behind.
        out += [f"{API}.CONSUMER.CREATE.{s}", S.js_flow_control(s)]
    return out


def _all_consumer_ops(s: str) -> list[str]:
    return [f"{API}.CONSUMER.*.{s}", f"{API}.CONSUMER.*.{s}.>", f"{API}.CONSUMER.DURABLE.CREATE.{s}.*",
            f"{API}.CONSUMER.MSG.NEXT.{s}.*", S.js_ack(s), S.js_flow_control(s)]


# Denied to every identity but the admin / syncer as noted, whatever the allow lists grow into later.
_NEVER_FOR_CLIENTS = [f"{API}.STREAM.DELETE.>", f"{API}.STREAM.UPDATE.>", f"{API}.STREAM.PURGE.>",
                      f"{API}.STREAM.MSG.DELETE.>", f"{API}.CONSUMER.MSG.DELETE.>", "$KV.>"]


def permissions(run: str, name: str, role: str, public_key: str, *, init_island: str | None = None) -> dict:
    """nats-server permissions of identity `name` (role `role`, nkey `public_key`) of run `run`:
    {"publish": {"allow": [...], "deny": [...]}, "subscribe": {"allow": [...]}}. Pure.

    The JetStream API subjects nats-py 2.16 really sends (nats/js/manager.py): stream info
    `$JS.API.STREAM.INFO.<stream>`, message get `$JS.API.STREAM.MSG.GET.<stream>`, direct get
    `$JS.API.DIRECT.GET.<stream>[.<subject>]`, consumer create `$JS.API.CONSUMER.CREATE.<stream>`
    (ephemeral / ordered), `...CREATE.<stream>.<name>[.<filter>]`, `...DURABLE.CREATE.<stream>.<name>`,
    info / delete / list / next, acks `$JS.ACK.<stream>.>`, flow control of ordered consumers
    `$JS.FC.<stream>.>`, KV writes `$KV.<bucket>.<key>`; replies come on the key's own inbox prefix
    `_INBOX_<public key>.>` (schemas/conn.py sets it when it connects with a seed).
    NATS wildcards match whole tokens only, and a consumer name is one token: so an island's consumers on
    CTL have fixed names, `pull-I` (filter `ctl.pull`) and `isl-I` (filter `ctl.to.I`), one filter each,
    which nats-py puts in the create subject `$JS.API.CONSUMER.CREATE.<CTL>.<name>.<filter>`. The server
    takes the consumer's name from that subject and refuses a config whose filter differs from it
    (tests/test_auth_permissions.py), so the rules name both exactly. The unnamed create
    `$JS.API.CONSUMER.CREATE.<stream>` is never allowed on CTL: the server accepts a `name` in its body
    there, and would create or reshape any consumer by that name. An island's consumers start at its
    hello's sequence (taken from the PubAck), so it needs no message read on CTL."""
    check_run(run)
    st = _streams(run)
    pub: list[str]
    # Each key reads only its own replies (schemas/conn.py connects with this inbox prefix); a shared
    # _INBOX.> would let an island read the syncer's direct gets of other islands' pushes.
    sub = [nkey_inbox_prefix(public_key) + ".>"]
    deny_pub: list[str] = []
    responses = False
    if role == "island":
        check_island(name)
        ctl = st["CTL"]
        pub = [S.push_island_all(run, name), S.hello(run, name), S.heartbeat(run, name), S.ack(run, name),
               S.steplog(run, name)]
        sub += run_advisories(run)   # stream leader elections (schemas/leader_watch.py)
        if name == init_island:
            pub.append(S.init_all(run))
        # check_run: every stream and bucket of the run must exist
        pub += [f"{API}.STREAM.INFO.{s}" for s in st.values()]
        # its two CTL consumers, by name and (in the create subject) filter: create / replace an
        # earlier generation's, inspect (who owns it), fetch, ack / nak, delete. Nothing else on CTL.
        for kind in S.ISLAND_CONSUMER_KINDS:
            c = S.island_consumer(name, kind)
            pub += [f"{API}.CONSUMER.CREATE.{ctl}.{c}.{S.island_consumer_filter(run, name, kind)}",
                    f"{API}.CONSUMER.INFO.{ctl}.{c}", f"{API}.CONSUMER.DELETE.{ctl}.{c}",
                    f"{API}.CONSUMER.MSG.NEXT.{ctl}.{c}", S.js_ack(ctl, c)]
        # the current cut and the final cut (ordered consumers, chunk reads), the session record
        pub += _read_stream(st["BCAST"]) + _read_stream(st["FINAL"]) + _read_stream(st["kv_state"])
        # Reading another island's push (its data's update) or forging one through a consumer is out.
        deny_pub = list(_NEVER_FOR_CLIENTS) + [f"{API}.CONSUMER.*.{st['PUSH']}.>", f"{API}.CONSUMER.*.{st['PUSH']}",
                                               f"{API}.DIRECT.GET.{st['PUSH']}", f"{API}.DIRECT.GET.{st['PUSH']}.>",
                                               f"{API}.STREAM.MSG.GET.{st['PUSH']}",
                                               # CTL's messages are read through its own consumers only
                                               f"{API}.CONSUMER.CREATE.{ctl}", f"{API}.CONSUMER.DURABLE.CREATE.{ctl}.>",
                                               f"{API}.STREAM.MSG.GET.{ctl}", f"{API}.DIRECT.GET.{ctl}",
                                               f"{API}.DIRECT.GET.{ctl}.>"]
        if name != init_island:
            deny_pub.append(S.init_all(run))
    elif role == "syncer":
        pub = [S.run_all(run), f"{API}.INFO"] + [S.kv_key(run, k, ">") for k in S.KV_KINDS]
        for s in st.values():
            pub += [f"{API}.STREAM.CREATE.{s}", f"{API}.STREAM.INFO.{s}", f"{API}.STREAM.PURGE.{s}",
                    f"{API}.STREAM.MSG.GET.{s}", f"{API}.STREAM.MSG.DELETE.{s}", f"{API}.DIRECT.GET.{s}",
                    f"{API}.DIRECT.GET.{s}.>"] + _all_consumer_ops(s)
        sub.append(S.run_all(run))
        sub += run_advisories(run)   # stream leader elections (schemas/leader_watch.py)
        # removing or reshaping the run is the admin's
        deny_pub = [f"{API}.STREAM.DELETE.>", f"{API}.STREAM.UPDATE.>"]
        # answering `yeto run set` on the requester's own inbox (one answer per request, as request/reply allows)
        responses = True
    elif role == "observer":
        pub = [f"{API}.INFO"]
        for s in (st["STEPLOG"], st["EVENTS"], st["kv_state"]):
            pub += _read_stream(s)
        pub += [f"{API}.CONSUMER.DELETE.{s}.*" for s in (st["STEPLOG"], st["EVENTS"], st["kv_state"])]
        sub += [S.steplog_all(run), S.events_all(run)]
        deny_pub = list(_NEVER_FOR_CLIENTS) + [S.run_all(run)]
    elif role == "admin":
        pub = [f"{API}.INFO", f"{API}.STREAM.NAMES", f"{API}.STREAM.LIST"]
        for s in st.values():
            pub += [f"{API}.STREAM.CREATE.{s}", f"{API}.STREAM.UPDATE.{s}", f"{API}.STREAM.DELETE.{s}",
                    f"{API}.STREAM.INFO.{s}", f"{API}.CONSUMER.*.{s}", f"{API}.CONSUMER.*.{s}.>",
                    f"{API}.CONSUMER.DURABLE.CREATE.{s}.*",
                    # a planned broker restart moves the run's stream leaders off a node first (`yeto broker
                    # --auth DIR` asks as the admin: services/broker_roll.py, docs/design.md §7.1)
                    f"{API}.STREAM.LEADER.STEPDOWN.{s}"]
        # provisioning and `yeto run set` (a request to the syncers on S.settings, in no stream): no other
        # message of the run, no KV write, no read of the weights
        pub.append(S.settings(run))
        deny_pub = [x for kind in S.STREAM_KINDS for x in S.stream_subjects(run, kind)] + [
            "$KV.>", f"{API}.STREAM.MSG.>", f"{API}.DIRECT.>", f"{API}.CONSUMER.MSG.>"]
    else:
        raise AuthError(f"role: must be one of {ROLES}, got {role!r}")
    perms: dict = {"publish": {"allow": pub}, "subscribe": {"allow": sub}}
    if deny_pub:
        perms["publish"]["deny"] = deny_pub
    if role == "syncer" and responses:
        perms["allow_responses"] = True
    return perms


# ---- identities and files -----------------------------------------------------------------------

@dataclass(frozen=True)
class Identity:
    name: str
    role: str
    public_key: str


def parse_islands(text: str) -> list[str]:
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if not names:
        raise AuthError(f"--islands: give at least one island id (comma separated), got {text!r}")
    for n in names:
        try:
            check_island(n)
        except Exception as exc:
            raise AuthError(f"--islands: {n!r} is not an island id ([A-Za-z0-9_-]+): {exc}") from None
        if n in RESERVED:
            raise AuthError(f"--islands: {n!r} is reserved for the {n} identity; name the island otherwise")
        if n.startswith(LEAF_PREFIX):
            raise AuthError(f"--islands: {n!r} starts with {LEAF_PREFIX!r}, the prefix of the datacenters' leaf "
                            f"identities; name the island otherwise")
    if len(set(names)) != len(names):
        raise AuthError(f"--islands: repeated island id in {text!r}")
    return names


def _quote(s: str) -> str:
    return json.dumps(s)  # nats-server's config reads JSON strings; quoting keeps `$JS...` from being a variable


def _perm_text(p: dict, indent: str) -> str:
    lines = []
    for kind in ("publish", "subscribe"):
        if kind not in p:
            continue
        parts = []
        for k in ("allow", "deny"):
            if p[kind].get(k):
                parts.append(f"{indent}    {k}: [" + ", ".join(_quote(x) for x in p[kind][k]) + "]")
        lines.append(f"{indent}  {kind}: {{\n" + "\n".join(parts) + f"\n{indent}  }}")
    if p.get("allow_responses"):
        lines.append(f"{indent}  allow_responses: true")
    return "\n".join(lines)


def _user_text(run: str, ident: Identity, p: dict, indent: str, extra: str = "") -> str:
    return (f"{indent}# run {run}: {ident.role} {ident.name}\n"
            f"{indent}{{\n{indent}  nkey: {ident.public_key}\n{extra}{indent}  permissions: {{\n"
            f"{_perm_text(p, indent + '  ')}\n{indent}  }}\n{indent}}}")


def _island_perms(run: str, identities: list[Identity], init_island: str | None) -> list[tuple[Identity, dict]]:
    return [(i, permissions(run, i.name, i.role, i.public_key, init_island=init_island))
            for i in identities if i.role == "island"]


def users_text(run: str, identities: list[Identity], init_island: str | None, indent: str = "    ",
               datacenter: str | None = None) -> str:
    """The `users` entries (one nkey user per identity, its permissions, its name as a comment).
    `datacenter` None: as the hub serves them, every identity; a leaf identity may connect only as a
    leaf node (services/leaf_auth.py). `datacenter` D: as D's leaf node serves them (islands and the
    admin, their JetStream API moved into the domains they use there)."""
    out = []
    islands = _island_perms(run, identities, init_island)
    # A leaf key opens no client session and a client key no leaf link: an island's key could otherwise
    # link a leaf node of its own (with its island permissions, but still a link nobody issued).
    as_client = f'{indent}  allowed_connection_types: ["STANDARD"]\n'
    for ident in identities:
        if ident.role == LEAF_ROLE:
            if datacenter is None:
                p = link_permissions(run, [(i.public_key, q) for i, q in islands])
                out.append(_user_text(run, ident, p, indent, f'{indent}  allowed_connection_types: ["LEAFNODE"]\n'))
            continue
        p = permissions(run, ident.name, ident.role, ident.public_key, init_island=init_island)
        if datacenter is not None:
            if ident.role not in ("island", "admin"):
                continue  # the syncer and the observer work at the hub
            p = served_permissions(p, ident.role, run, datacenter)
        out.append(_user_text(run, ident, p, indent, as_client))
    return "\n".join(out)


def auth_conf_text(runs: list[tuple[str, list[Identity], str | None]], datacenter: str | None = None) -> str:
    """A nats-server `authorization` block with the users of every (run, identities, init island), as the
    hub serves them, or as the leaf node of `datacenter` does."""
    body = "\n".join(users_text(r, ids, init, datacenter=datacenter) for r, ids, init in runs)
    return ("# Generated by `yeto auth init`: public keys and permissions only (the seeds are the .creds files).\n"
            "# No no_auth_user: a client without a key is refused.\n"
            "authorization {\n  timeout: 5\n  users = [\n" + body + "\n  ]\n}\n")


def tls_block(tls_dir: str | os.PathLike) -> str:
    d = Path(tls_dir) if Path(tls_dir).is_absolute() else Path(tls_dir).resolve()
    return ("tls {\n"
            f"  cert_file: {_quote(str(d / 'server.pem'))}\n"
            f"  key_file: {_quote(str(d / 'server-key.pem'))}\n"
            "  timeout: 5\n"
            "}\n")


def load_identities(auth_dir: str | os.PathLike) -> tuple[str, list[Identity], str | None]:
    d = Path(auth_dir)
    try:
        rec = json.loads((d / IDENTITIES_FILE).read_text())
    except FileNotFoundError:
        raise AuthError(f"auth dir {str(d)!r}: no {IDENTITIES_FILE} (make it with `yeto auth init --out {d}`)") from None
    ids = [Identity(n, v["role"], v["public_key"]) for n, v in rec["identities"].items()]
    return rec["run"], ids, rec.get("init_island")


def server_config_text(auth_dirs: list[str | os.PathLike], base_config: str | os.PathLike | None = None,
                       *, tls: bool | None = None, served_dir: str | None = None, base_text: str | None = None,
                       datacenter: str | None = None) -> str:
    """A whole nats-server config: the base settings (default: the shipped services/nats.conf), the
    users of every auth dir (several runs may share one broker), and a TLS block when the first dir
    has `tls/` (or `tls=True`). What `yeto broker --auth DIR` serves. `served_dir`: where the server
    sees the first dir when that differs from here (a container's mount, e.g. /etc/yeto-auth); the
    TLS file paths use it. `base_text`: the base settings themselves (a generated hub or leaf config,
    services/leaf.py) instead of a file; `datacenter`: serve the identities as that datacenter's leaf
    node does (services/leaf_auth.py)."""
    if base_config is None and base_text is None:
        from yeto.services.broker import default_config_path

        base_config = default_config_path()
    runs = [load_identities(d) for d in auth_dirs]
    seen = {}
    for d, (run, _ids, _i) in zip(auth_dirs, runs):
        if run in seen:
            raise AuthError(f"auth dirs {seen[run]!r} and {str(d)!r} are both for run {run!r}")
        seen[run] = str(d)
    base = base_text if base_text is not None else Path(base_config).read_text()
    text = base + "\n" + auth_conf_text(runs, datacenter)
    tls_dir = Path(auth_dirs[0]) / TLS_DIR
    if tls or (tls is None and (tls_dir / "server.pem").exists()):
        text += tls_block(tls_dir if served_dir is None else f"{served_dir.rstrip('/')}/{TLS_DIR}")
    return text


def write_server_config(auth_dirs: list[str | os.PathLike], out: str | os.PathLike,
                        base_config: str | os.PathLike | None = None, *, tls: bool | None = None,
                        served_dir: str | None = None, base_text: str | None = None,
                        datacenter: str | None = None) -> Path:
    out = Path(out)
    _write_private(out, server_config_text(auth_dirs, base_config, tls=tls, served_dir=served_dir,
                                           base_text=base_text, datacenter=datacenter))
    return out


def datacenters_of(auth_dir: str | os.PathLike) -> list[str]:
    """The datacenters DIR holds leaf identities for."""
    _run, ids, _init = load_identities(auth_dir)
    return [i.name[len(LEAF_PREFIX):] for i in ids if i.role == LEAF_ROLE]


def leaf_seed(auth_dir: str | os.PathLike, datacenter: str) -> str:
    """The seed of datacenter `datacenter`'s leaf identity in DIR; AuthError saying how to issue it."""
    d = Path(auth_dir)
    run, ids, _init = load_identities(d)
    creds = d / f"{leaf_name(datacenter)}.creds"
    if not any(i.role == LEAF_ROLE and i.name == leaf_name(datacenter) for i in ids) or not creds.exists():
        have = datacenters_of(d)
        raise AuthError(f"--domain {datacenter}: {d} has no leaf credentials for datacenter {datacenter!r} "
                        f"(it has: {', '.join(have) or 'none'}); run `yeto auth init --run {run} --islands <the "
                        f"run's islands> --out {d} --datacenters {datacenter}` and copy {creds.name} here")
    return creds.read_text().strip()


def _write_private(path: Path, data: str | bytes) -> None:
    """Write atomically with mode 0600 from the first byte (never briefly world-readable)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _new_seed() -> tuple[bytes, str]:
    """A fresh nkey user key pair: (seed, public key)."""
    import nacl.signing  # PyNaCl, a dependency of nkeys
    import nkeys

    raw = nacl.signing.SigningKey.generate().encode()
    seed = nkeys.encode_seed(raw, nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    try:
        return bytes(seed), kp.public_key.decode()
    finally:
        kp.wipe()


def _public_of(seed_file: Path) -> str:
    import nkeys

    kp = nkeys.from_seed(bytearray(seed_file.read_bytes().strip()))
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()


@dataclass
class InitReport:
    run: str
    out: Path
    created: list[str]
    kept: list[str]
    tls: list[str]
    init_island: str | None
    datacenters: list[str] = ()


def init_auth(run: str, islands: list[str], out: str | os.PathLike, *, init_island: str | None = None,
              tls: bool = False, hosts: list[str] | None = None, datacenters: list[str] | None = None) -> InitReport:
    """`yeto auth init`: create or extend DIR. Existing identities keep their keys; new islands get new
    ones; auth.conf is rewritten from the union. `datacenters`: one leaf identity `leaf-<dc>` per island
    datacenter (added to those DIR has), for its leaf node's link to the hub (services/leaf_auth.py).

    Writes, the private files mode 0600:
    * `<identity>.creds` — one NATS nkey user seed per identity (`syncer`, each island, `observer`,
      `admin`, made with the nats-io `nkeys` package); `--nats-creds FILE` takes it as is (schemas/conn.py
      hands a bare seed to nats-py's `nkeys_seed=`, a JWT .creds file to `user_credentials=`);
    * `auth.conf` — a nats-server `authorization` block: one nkey user per identity with its
      publish/subscribe allow and deny lists (`permissions`);
    * `identities.json` — the public half (run, INIT island, name -> role and public key), read back by a
      second `yeto auth init` on DIR;
    * `server.conf` — a whole nats-server config: services/nats.conf's settings, the users, and a `tls`
      block when `tls/` holds a certificate (`yeto broker --config DIR/server.conf`);
    * with `tls`: `tls/ca.pem`, `ca-key.pem`, `server.pem`, `server-key.pem` (made with `cryptography`);
      clients verify the server with `--tls-ca DIR/tls/ca.pem`;
    * with `datacenters`: `leaf-<dc>.creds` (role `leaf`: it may connect only as a leaf node)."""
    check_run(run)
    datacenters = parse_datacenters(",".join(datacenters or ()), AuthError)
    hosts = list(DEFAULT_HOSTS if hosts is None else hosts)
    if tls and not hosts:
        raise AuthError("--hosts: give at least one host name or address")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    existing: dict[str, Identity] = {}
    prev_init = None
    if (out / IDENTITIES_FILE).exists():
        prev_run, ids, prev_init = load_identities(out)
        if prev_run != run:
            raise AuthError(f"--run: {out} holds identities of run {prev_run!r}, not {run!r}; "
                            f"use another --out for another run")
        existing = {i.name: i for i in ids}
    all_islands = [i.name for i in existing.values() if i.role == "island"]
    all_islands += [n for n in islands if n not in all_islands]
    if init_island is None:
        init_island = prev_init or all_islands[0]
    elif init_island not in all_islands:
        raise AuthError(f"--init-island: {init_island!r} is not one of the islands {all_islands}")
    all_dcs = [i.name for i in existing.values() if i.role == LEAF_ROLE]
    all_dcs += [leaf_name(d) for d in datacenters or () if leaf_name(d) not in all_dcs]
    wanted = [("syncer", "syncer"), *((n, "island") for n in all_islands), ("observer", "observer"), ("admin", "admin"),
              *((n, LEAF_ROLE) for n in all_dcs)]
    created, kept, final = [], [], []
    for name, role in wanted:
        creds = out / f"{name}.creds"
        ident = existing.get(name)
        if ident is not None and creds.exists():
            if _public_of(creds) != ident.public_key:
                raise AuthError(f"{creds}: its key is not the one recorded in {IDENTITIES_FILE} for {name!r}; "
                                f"restore the file or remove both to issue a new identity")
            os.chmod(creds, 0o600)
            kept.append(name)
            final.append(ident)
            continue
        seed, pub = _new_seed()
        _write_private(creds, seed + b"\n")
        created.append(name)
        final.append(Identity(name, role, pub))
    rec = {"run": run, "init_island": init_island,
           "identities": {i.name: {"role": i.role, "public_key": i.public_key} for i in final}}
    _write_private(out / IDENTITIES_FILE, json.dumps(rec, indent=2) + "\n")
    _write_private(out / AUTH_CONF, auth_conf_text([(run, final, init_island)]))
    tls_files: list[str] = []
    if tls:
        tls_files = make_tls(out / TLS_DIR, hosts)
    # A whole broker config (shipped settings + these users + TLS when DIR/tls has a certificate), so
    # `yeto broker --config DIR/server.conf` serves it as is.
    write_server_config([out], out / SERVER_CONF)
    return InitReport(run, out, created, kept, tls_files, init_island,
                      [i.name[len(LEAF_PREFIX):] for i in final if i.role == LEAF_ROLE])


# ---- TLS ------------------------------------------------------------------------------------------

def _san(hosts: list[str]):
    from cryptography import x509

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def cert_hosts(cert_pem: bytes) -> list[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in san.get_values_for_type(x509.DNSName)] + \
           [str(v) for v in san.get_values_for_type(x509.IPAddress)]


def make_tls(tls_dir: Path, hosts: list[str], *, days: int = 825) -> list[str]:
    """A CA (kept when it exists) and a server certificate for `hosts` signed by it (re-issued when
    missing or when the hosts changed). ECDSA P-256; keys mode 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise AuthError("--hosts: give at least one host name or address")
    tls_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(tls_dir, 0o700)
    now = _dt.datetime.now(_dt.timezone.utc)
    pem = serialization.Encoding.PEM
    written = []

    def key_bytes(k) -> bytes:
        return k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_pem, ca_key_pem = tls_dir / "ca.pem", tls_dir / "ca-key.pem"
    if ca_pem.exists() and ca_key_pem.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_pem.read_bytes(), None)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "yeto-nats run CA")])
        ca_cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=3650))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
                   .sign(ca_key, hashes.SHA256()))
        _write_private(ca_key_pem, key_bytes(ca_key))
        ca_pem.write_bytes(ca_cert.public_bytes(pem))  # public: clients need it
        written += ["ca.pem", "ca-key.pem"]
    srv_pem, srv_key_pem = tls_dir / "server.pem", tls_dir / "server-key.pem"
    if srv_pem.exists() and srv_key_pem.exists() and sorted(cert_hosts(srv_pem.read_bytes())) == sorted(hosts):
        return written
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(srv_key_pem, key_bytes(key))
    _write_private(srv_pem, cert.public_bytes(pem))
    return written + ["server.pem", "server-key.pem"]
