"""The per-host roadlog node daemon: Raft core, storage, state machine."""
