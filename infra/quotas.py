"""What a tenant may grow in the shared stores: the deployment's quotas on Terraform state
(executor/statefile.py, executor/stateledger.py) and on step logs (executor/logstream.py).

Each is a deployment setting (a flag of `up`, `api` and `executor`, and a `RUNPLANE_*`
variable), with a safe default and a ceiling no deployment may pass: a state is one
message stream of chunks in `rp-state` and one `terraform show` in an executor, and the
ledger that counts an organization's versions is one KV value, which must stay under
NATS's default payload of 1 MiB (`LEDGER_MAX_BYTES`): so an organization keeps at most
`LEDGER_MAX_BYTES // LEDGER_ENTRY_BYTES` versions.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024
# An organization's state ledger (executor/stateledger.py) is one KV value: with room
# to spare under NATS's default max_payload of 1 MiB. A version's entry there is at most
# LEDGER_ENTRY_BYTES: names of 63 characters, a serial of 20 digits, a size of 10, a comma
# (measured by tests/test_quota_ledger.py), so the versions an organization may keep
# have a ceiling of 3,686.
LEDGER_MAX_BYTES = 900 * 1024
LEDGER_ENTRY_BYTES = 250
VERSIONS_PER_ORG_CEILING = LEDGER_MAX_BYTES // LEDGER_ENTRY_BYTES

# name: (default, lowest, ceiling), in the unit the flag takes (MiB for sizes)
RANGES: dict[str, tuple[int, int, int]] = {
    "state_max_mb": (64, 1, 1024),
    "state_versions_per_workspace": (100, 2, 1000),
    "state_mb_per_workspace": (2048, 1, 1024 * 1024),
    "state_versions_per_org": (2000, 2, VERSIONS_PER_ORG_CEILING),
    "state_mb_per_org": (20480, 1, 16 * 1024 * 1024),
    "log_max_mb": (64, 1, 4096),
}
ENV = {name: f"RUNPLANE_{name.upper()}" for name in RANGES}
FLAGS = {name: "--" + name.replace("_", "-") for name in RANGES}


@dataclass(frozen=True)
class Quotas:
    """The deployment's quotas, in MiB and counts (see RANGES for defaults and bounds)."""

    state_max_mb: int = RANGES["state_max_mb"][0]
    state_versions_per_workspace: int = RANGES["state_versions_per_workspace"][0]
    state_mb_per_workspace: int = RANGES["state_mb_per_workspace"][0]
    state_versions_per_org: int = RANGES["state_versions_per_org"][0]
    state_mb_per_org: int = RANGES["state_mb_per_org"][0]
    log_max_mb: int = RANGES["log_max_mb"][0]

    def problems(self) -> list[str]:
        """Each setting out of its range, as `--flag wants LOW to HIGH`."""
        out = []
        for name, (_, low, high) in RANGES.items():
            if not low <= getattr(self, name) <= high:
                out.append(f"{FLAGS[name]} wants {low} to {high}, got {getattr(self, name)}")
        if self.state_mb_per_workspace < 2 * self.state_max_mb:
            out.append("--state-mb-per-workspace must hold two states of --state-max-mb")
        return out

    @property
    def state_max_bytes(self) -> int:
        return self.state_max_mb * MIB

    @property
    def state_bytes_per_workspace(self) -> int:
        return self.state_mb_per_workspace * MIB

    @property
    def state_bytes_per_org(self) -> int:
        return self.state_mb_per_org * MIB

    @property
    def log_max_bytes(self) -> int:
        return self.log_max_mb * MIB
