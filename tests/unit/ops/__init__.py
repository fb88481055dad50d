"""Unit tests of the deploy and operations: fabfile, Ansible roles, monitoring rules."""
