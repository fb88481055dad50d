"""Unit tests of roadlog.tools: the operators' tools (the ops logic behind fab)."""
