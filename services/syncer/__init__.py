"""The syncer: pure round state machine (rounds), outer optimizer (outer), I/O shell (service)."""
