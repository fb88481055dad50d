"""Unit tests of roadlog.runtime: what every daemon runs on (auth, config and
secrets, event loop, frames, health, TLS, sdnotify)."""
