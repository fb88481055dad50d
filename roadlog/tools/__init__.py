"""The tools layer, above the daemons: what a developer or an operator runs
against a cluster, never what a cluster runs.

localcluster (a cluster of real processes on 127.0.0.1), ops (the operator's
decisions, pure functions for the Fabric CLI and the playbooks' checks),
probe (a write probe for drills) and traffic (simulated traffic). The CLI
(roadlog.cli) belongs to this layer too. Daemons, discovery and the runtime
never import it; the process helpers and the leadership logic they share
with it live below, in roadlog.runtime.processes and roadlog.leadership.
"""
