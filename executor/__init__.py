"""The executor: pulls dispatched phases, runs Terraform offline, reports run events.

Composition root usage (the CLI)::

    ex = Executor(nc, app, pool="default", work_dir=data_dir / "work", repositories=sources)
    async with ex:
        install_signal_handlers(ex)  # or: await wait_for_signal(), then leave the block
        await ex.run()               # returns once stop() has wound it down
"""

from executor.errors import ExecutorError, SetupError, StepFailed
from executor.terraform import TerraformConfig
from executor.worker import Executor, TerraformSettings, install_signal_handlers

__all__ = [
    "Executor",
    "ExecutorError",
    "SetupError",
    "StepFailed",
    "TerraformConfig",
    "TerraformSettings",
    "install_signal_handlers",
]
