"""Plugins for training frameworks. Each file here is meant to be passed by path (ms-swift's
`--external_plugins learner/plugins/yeto_swift_plugin.py`): the framework puts this folder on sys.path,
so it holds nothing whose name could shadow another module."""
