"""yeto-nats, installed as one namespace: `yeto.schemas` (the wire contract), `yeto.services` (syncer, broker,
step-log consumers, the `yeto` command) and `yeto.learner` (the island side, the ms-swift plugin).

In the repository the three live at its top (`schemas/`, `services/`, `learner/`); the wheel puts them under
`yeto/` (pyproject.toml `package-dir`), so a training repository's own `schemas/` can never shadow ours. From a
checkout (tests, benches, `python -m yeto.services.cli` in the repository root) the folders beside this one are
this package's subpackages: the repository root is on its search path.
"""
import os as _os

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
# Only a yeto-nats checkout (its pyproject.toml and wire schemas beside this folder), never the site-packages
# an installed wheel lies in, where another distribution's `services/` would make every module there a
# `yeto.*` module.
if (_os.path.isfile(_os.path.join(_ROOT, "pyproject.toml"))
        and _os.path.isdir(_os.path.join(_ROOT, "schemas", "json")) and _ROOT not in __path__):
    __path__.append(_ROOT)
