"""Traces: W3C trace context from the HTTP request through events, the scheduler, the
executor and subscriber deliveries; spans per request, command, phase, step and delivery;
exported over OTLP/HTTP only when configured.

The context travels in headers: `traceparent` (and `tracestate`) on every event the
event store appends while a span is current, on every dispatch message, and is taken
back from a message's headers by `span_from_headers`, whose span becomes the current one
(asyncio tasks copy it, so a phase's task and its appends carry the phase's trace).

`setup` installs the process's tracer provider, once. Exporting is configured by
`RUNPLANE_OTLP_ENDPOINT` (a collector's base URL; `/v1/traces` is added) or the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (with the SDK's
other `OTEL_*` settings: headers, timeout, sampler, service name). Without an exporter,
root spans are not sampled: a request still gets a trace id that its events, dispatches
and phases share (flags `00`), but no span is recorded, so tracing costs an id and a
header; a caller's sampled `traceparent` is honoured all the same. A process that never
calls `setup` (tests, library use) runs OpenTelemetry's no-op tracer: it only passes on
a context it is given.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import threading
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = structlog.get_logger(__name__)

P = ParamSpec("P")
T = TypeVar("T")
H = TypeVar("H", bound=MutableMapping[str, str])

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# A caller's `tracestate` longer than this is dropped, not stored in every event of its
# request (W3C: propagate at least 512 characters; beyond, a system may cut it).
TRACESTATE_MAX = 512
ENDPOINT_ENV = "RUNPLANE_OTLP_ENDPOINT"
_OTEL_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXPORT_TIMEOUT_S = 5.0  # per export request (the SDK's default is 10)

_propagator = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("runplane")  # follows the provider `setup` installs
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_lock = threading.Lock()
_provider: TracerProvider | None = None
_quiet = False  # the provider exports nothing: unsampled spans are made by `Started`


# ---------------------------------------------------------------- the process's provider


def otlp_endpoint(env: Mapping[str, str]) -> str:
    """The OTLP/HTTP traces URL the environment names ("": none, or the SDK's own
    `OTEL_*` reading when only those are set: then "otel")."""
    base = env.get(ENDPOINT_ENV, "").strip()
    if base:
        base = base.rstrip("/")
        return base if base.endswith("/v1/traces") else base + "/v1/traces"
    return "otel" if any(env.get(k, "").strip() for k in _OTEL_ENDPOINTS) else ""


def exporter_processor(env: Mapping[str, str]) -> SpanProcessor | None:
    """A batching OTLP/HTTP exporter when the environment configures one, else None.
    Exports run on the processor's own thread: a slow collector never holds the loop."""
    endpoint = otlp_endpoint(env)
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if endpoint == "otel":  # the SDK reads OTEL_EXPORTER_OTLP_* itself (headers, TLS too)
        exporter = OTLPSpanExporter()
    else:
        timeout = None if "OTEL_EXPORTER_OTLP_TIMEOUT" in env else EXPORT_TIMEOUT_S
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout)
    return BatchSpanProcessor(exporter)


def setup(
    service: str,
    *,
    env: Mapping[str, str] | None = None,
    processors: Sequence[SpanProcessor] = (),
) -> TracerProvider:
    """Install this process's tracer provider (once: a later call returns the first).

    `service` names the process (`service.name`, unless `OTEL_SERVICE_NAME` says
    otherwise). `processors`: more span processors (tests pass an in-memory exporter's).
    `OTEL_SDK_DISABLED=true` installs a provider that records nothing."""
    global _provider, _quiet
    env = os.environ if env is None else env
    with _lock:
        if _provider is not None:
            return _provider
        exporting = [p for p in (exporter_processor(env),) if p is not None]
        exporting += processors
        attrs = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service}
        kwargs: dict[str, Any] = {"resource": Resource.create(attrs)}
        if not exporting:
            kwargs["sampler"] = ParentBased(ALWAYS_OFF)  # module docstring
        provider = TracerProvider(**kwargs)
        for p in exporting:
            provider.add_span_processor(p)
        trace.set_tracer_provider(provider)
        _provider, _quiet = provider, not exporting
        log.info("tracing", service=service, exporter=otlp_endpoint(env) or None)
        return provider


def shutdown() -> None:
    """Export what is still buffered (bounded by the exporter's timeout); at exit."""
    if _provider is not None:
        _provider.shutdown()


# ---------------------------------------------------------------- propagation


def inject(headers: H) -> H:
    """Add the current span's `traceparent` (and `tracestate`) to `headers`; nothing if no
    span is current. Returns `headers`, for use in an expression."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        _propagator.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The context a message's or request's headers carry (an empty one if none, or if
    they are malformed: a bad `traceparent` is ignored, never an error)."""
    if not headers:
        return otel_context.Context()
    carrier = {}
    for key in (TRACEPARENT, TRACESTATE):
        value = headers.get(key)
        if value is None:
            value = headers.get(key.title())  # HTTP header names: any case
        if value and (key == TRACEPARENT or len(value) <= TRACESTATE_MAX):
            carrier[key] = value
    if TRACEPARENT not in carrier:
        return otel_context.Context()
    return _propagator.extract(carrier, context=otel_context.Context())


def span_from_headers(
    name: str,
    headers: Mapping[str, str] | None,
    *,
    kind: SpanKind = SpanKind.CONSUMER,
    **attrs: Any,
) -> Started:
    """A span whose parent is the context in `headers` (a new trace if none), current
    for the block (`with ... as span`). Attributes with a None value are left out."""
    return Started(name, extract(headers), kind, attrs)


def span(name: str, *, kind: SpanKind = SpanKind.INTERNAL, **attrs: Any) -> Started:
    """A child span of the current one, current for the block."""
    return Started(name, None, kind, attrs)


class Started:
    """A span, current for a `with` block. With nothing to export (`_quiet`) a span no
    one sampled is made here, not by the SDK: the ids and flags its `ParentBased
    (ALWAYS_OFF)` would give, at a fraction of the cost (every request, command and
    delivery has one). A class, not a generator: this is on every request's path."""

    __slots__ = ("_attrs", "_cm", "_ctx", "_kind", "_name", "_token")

    def __init__(
        self, name: str, ctx: otel_context.Context | None, kind: SpanKind, attrs: Mapping[str, Any]
    ) -> None:
        self._name, self._ctx, self._kind, self._attrs = name, ctx, kind, attrs
        self._cm: AbstractContextManager[Span] | None = None
        self._token: object = None

    def __enter__(self) -> Span:
        if _quiet:
            parent = trace.get_current_span(self._ctx).get_span_context()
            if not parent.trace_flags.sampled:
                bare = _unsampled(parent)
                self._token = otel_context.attach(trace.set_span_in_context(bare, self._ctx))
                return bare
        self._cm = _tracer.start_as_current_span(
            self._name, self._ctx, self._kind, _attrs(self._attrs)
        )
        return self._cm.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._cm is not None:
            return self._cm.__exit__(exc_type, exc, tb)
        otel_context.detach(self._token)  # type: ignore[arg-type]  # attach's token
        return None


def _unsampled(parent: SpanContext) -> NonRecordingSpan:
    """A span that records nothing, in its parent's trace (a new one if none)."""
    valid = parent.is_valid
    return NonRecordingSpan(
        SpanContext(
            parent.trace_id if valid else (random.getrandbits(128) or 1),
            random.getrandbits(64) or 1,
            False,
            _UNSAMPLED,
            parent.trace_state if valid else None,
        )
    )


def annotate(name: str = "", **attrs: Any) -> None:
    """Rename (if `name`) and add attributes to the current span, if it records."""
    s = trace.get_current_span()
    if s.is_recording():
        if name:
            s.update_name(name)
        s.set_attributes(_attrs(attrs))


def trace_id() -> str:
    """The current trace id in hex ("" if none): for log lines."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def _attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {f"runplane.{k}": v for k, v in attrs.items() if v is not None and v != ""}


# ---------------------------------------------------------------- commands

_NAMED = ("org", "ws", "name", "run_id")  # the arguments a command's span is labelled with


def command(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """A span per call of an application command (`command <name>`), labelled with the
    organization, workspace and run it names."""
    params = list(inspect.signature(fn).parameters)
    where = {p: i for i, p in enumerate(params) if p in _NAMED}
    title = f"command {fn.__name__}"

    @functools.wraps(fn)
    async def traced(*args: P.args, **kwargs: P.kwargs) -> T:
        with Started(title, None, SpanKind.INTERNAL, {}) as s:
            if s.is_recording():
                for p, i in where.items():
                    value = kwargs.get(p, args[i] if i < len(args) else None)
                    if isinstance(value, str) and value:
                        s.set_attribute(f"runplane.{'workspace' if p == 'ws' else p}", value)
            return await fn(*args, **kwargs)

    return traced
