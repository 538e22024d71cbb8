"""TEST-ONLY STUB (see transformer_engine/__init__.py): an empty `transformer_engine.pytorch`."""
