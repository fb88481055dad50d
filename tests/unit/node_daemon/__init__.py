"""Unit tests of the node daemon, one folder per layer; here its top-level modules (config)."""
