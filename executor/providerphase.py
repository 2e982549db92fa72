"""A phase's providers from the executor host's cache (executor/providers.py), before
its `terraform init`: the lock file's packages linked into a mirror of the phase's own,
which Terraform's CLI configuration for the phase names first."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

from executor.job import Job
from executor.process import StepLog
from executor.providers import use_cache
from executor.terraform import cli_config_text


async def cached_providers(job: Job, step_log: StepLog) -> None:
    """Before the phase's `terraform init`: its locked providers from the host's cache
    (`use_cache`), Terraform pointed at the phase's own mirror first."""
    tools, ctx = job.tools, job.ctx
    cache = tools.terraform.provider_cache
    if cache is None:
        return
    served = await asyncio.to_thread(use_cache, cache, ctx.workdir, ctx.src, ctx.root)
    if not served:
        return
    job.providers_cached = True
    config = ctx.root / "terraform.rc"
    mirrors = [ctx.root / "providers", *tools.terraform.mirrors]
    config.write_text(cli_config_text(mirrors))
    os.chmod(config, 0o644)
    tools.terraform = replace(tools.terraform, cli_config=config)
    fresh = sum(entry.fresh for entry in served.values())
    how = f"{fresh} unpacked now" if fresh else "all cached"
    names = ", ".join(f"{s} ({e.h1})" for s, e in sorted(served.items()))
    step_log.note(
        f"providers from the executor's cache, checked against the lock file ({how}): {names}"
    )
