"""One set of rules for every user-facing config field, and one shape of message.

Why a module of its own: ``ScalingConfig``, ``RunConfig``, ``FailureConfig``,
``CheckpointConfig``, ``CapacityPolicy`` and the Ray Train shim all take counts, seconds,
flags, names and storage URIs from the user. Each field used to be checked by hand, and
the gaps reached Ray: ``True`` taken as the int 1 (``bool`` is a subclass of ``int``),
``"yes"`` taken as a true flag, NaN passing every comparison (``nan < 0`` is False), a
worker that reserves no resource at all. Here each rule is written once; every field is
checked at construction, before ``ray.init`` or any actor, and the error is a
:class:`~raylastic.errors.ConfigError` that reads ``<Class>.<field>=<value> must be <what>.
Fix: <how>.`` ``tests/unit/test_validation.py`` walks every field of every class against
these rules.

Nothing here imports Ray, torch or pyarrow at module level: configs stay cheap to import
(the storage URI check imports the storage backends only for a URI).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Mapping, Optional

from raylastic.errors import ConfigError

_GLOB_CHARS = "*?[]"
_SEPARATORS = "/\\"
_MAX_NAME_BYTES = 255  # a directory name on every local filesystem raylastic runs on
# A URI scheme written without its '//' ("s3:/bucket", "gs:bucket"): read as a local path,
# it would silently write a local directory named "s3:".
_SCHEME_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def error(field: str, value: Any, want: str, fix: str, *, wrong_type: bool = False) -> ConfigError:
    """``<field>=<value> must be <want>[, not a <type>]. Fix: <fix>.``"""
    kind = ""
    if wrong_type and value is not None:  # a bool for an int, a str for a flag, a numpy scalar, ...
        module = type(value).__module__
        name = f"{'' if module == 'builtins' else module + '.'}{type(value).__name__}"
        kind = f", not {'an' if name[0] in 'aeiou' else 'a'} {name}"
    return ConfigError(f"{field}={_shown(value)} must be {want}{kind}. Fix: {fix}.")


def is_int(value: Any) -> bool:
    """A real int: ``True`` is not the count 1, ``1.0`` and ``numpy.int64`` are not ints."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool): NaN slips through every comparison, and an
    infinite delay or limit is spelled ``None`` where the field allows it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond any float: no real count of seconds or resources
        return False


def check_int(value: Any, field: str, *, minimum: Optional[int], fix: str, none_means: Optional[str] = None) -> None:
    """An int (not a bool) >= ``minimum`` (no bound: None); None allowed when ``none_means``
    says what None means."""
    if value is None and none_means is not None:
        return
    if is_int(value) and (minimum is None or value >= minimum):
        return
    want = "an int" + (f" >= {minimum}" if minimum is not None else "")
    raise error(
        field, value, want + (f" or None ({none_means})" if none_means else ""), fix, wrong_type=not is_int(value)
    )


def check_number(
    value: Any,
    field: str,
    *,
    minimum: Optional[float] = None,
    above: Optional[float] = None,
    maximum: Optional[float] = None,
    fix: str,
    none_means: Optional[str] = None,
    unit: str = "",
) -> None:
    """A finite number (not a bool) >= ``minimum`` / > ``above`` / <= ``maximum``."""
    if value is None and none_means is not None:
        return
    ok = (
        is_number(value)
        and (minimum is None or value >= minimum)
        and (above is None or value > above)
        and (maximum is None or value <= maximum)
    )
    if ok:
        return
    bounds = [
        f">= {minimum:g}" if minimum is not None else "",
        f"> {above:g}" if above is not None else "",
        f"<= {maximum:g}" if maximum is not None else "",
    ]
    want = " and ".join(b for b in bounds if b)
    want = f"a finite number{' of ' + unit if unit else ''}" + (f" {want}" if want else "")
    raise error(
        field,
        value,
        want + (f" or None ({none_means})" if none_means else ""),
        fix,
        wrong_type=isinstance(value, bool) or not isinstance(value, (int, float)),
    )


def check_bool(value: Any, field: str, fix: Optional[str] = None) -> None:
    """``True`` or ``False``: ``"no"`` is truthy, and ``1``/``numpy.bool_`` hide a mix-up."""
    if isinstance(value, bool):
        return
    short = field.rsplit(".", 1)[-1]
    raise error(field, value, "True or False", fix or f"pass {short}=True or {short}=False", wrong_type=True)


def check_instance(value: Any, cls: type, field: str, example: str, *, optional: bool = False) -> None:
    """An instance of ``cls`` (``None`` too when ``optional``)."""
    if (value is None and optional) or isinstance(value, cls):
        return
    want = f"a {cls.__module__}.{cls.__name__}" + (" or None" if optional else "")
    raise error(field, value, want, f"pass {example}", wrong_type=True)


def control_chars(text: str) -> bool:
    """C0/C1 control characters and DEL: they forge lines in logs and event files."""
    return any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in text)


def check_text(value: Any, field: str, *, fix: str, optional: bool = False) -> None:
    """A non-empty string without control characters."""
    if value is None and optional:
        return
    if isinstance(value, str) and value.strip() and not control_chars(value):
        return
    raise error(
        field,
        value,
        "a non-empty string without control characters" + (" or None" if optional else ""),
        fix,
        wrong_type=not isinstance(value, str),
    )


def check_resources(value: Any, field: str) -> None:
    """Ray resources per worker: ``{name: amount}``, names non-empty strings, amounts finite
    and >= 0 (a zero amount reserves nothing of that resource, as in Ray). Whether the
    whole mapping reserves anything is the caller's check (it knows the defaults)."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise error(
            field,
            value,
            "a dict like {'CPU': 1} or None (one CPU)",
            "pass e.g. resources_per_worker={'CPU': 2}",
            wrong_type=True,
        )
    for name, amount in value.items():
        if not isinstance(name, str) or not name.strip() or control_chars(name):
            raise ConfigError(
                f"{field} has a bad key {name!r}: resource names are non-empty strings "
                "without control characters. Fix: use Ray's names ('CPU', 'GPU', 'memory') "
                "or a custom resource the nodes are started with."
            )
        check_number(
            amount, f"{field}[{name!r}]", minimum=0, fix=f"pass an amount such as 1 or 0.5 (0 reserves no {name})"
        )


def check_reserves_something(resources: Mapping[str, float], field: str) -> None:
    """A worker must reserve some resource: with nothing reserved Ray places any number of
    workers on any node, so placement, node-loss accounting and capacity waits mean nothing."""
    if any(v > 0 for v in resources.values()):
        return
    raise ConfigError(
        f"{field}={dict(resources)!r} reserves nothing per worker: Ray would place any number "
        "of workers on one node. Fix: ask for at least one resource > 0, e.g. {'CPU': 1}, "
        "or a custom resource such as {'CPU': 0, 'trainer_slot': 1}."
    )


def run_name_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot be a run's directory name, or None (see docs/security.md)."""
    if not isinstance(name, str) or name.strip() == "":
        return "it must be a non-empty string"
    if name in (".", ".."):
        return "'.' and '..' are not directory names"
    bad = sorted({c for c in name if c in _GLOB_CHARS + _SEPARATORS})
    if bad:
        return f"it contains {', '.join(repr(c) for c in bad)}"
    if control_chars(name):
        return "it contains a control character"
    if len(name.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES:
        return f"it is longer than {_MAX_NAME_BYTES} bytes, the longest directory name"
    return None


def check_storage_path(value: Any, field: str) -> str:
    """A local path or a URI of a scheme raylastic's storage supports (the storage
    backends' own ``parse_uri``: scheme, no credentials in the URI, known options, no '..');
    on an object store no glob characters either (adlfs reads them as patterns and would
    list other runs). Returns the path as a string."""
    fix_uri = (
        "pass a local path or s3://bucket/path, gs://bucket/path, "
        "abfs://container@account.dfs.core.windows.net/path (docs/storage.md)"
    )
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip() or control_chars(value):
        raise error(
            field,
            value,
            "a non-empty path or URI string without control characters",
            fix_uri,
            wrong_type=not isinstance(value, str),
        )
    if "://" not in value:
        m = _SCHEME_PREFIX.match(value)
        if m is not None:
            from raylastic.checkpoint.backends import _SCHEMES  # here: imports pyarrow

            if m.group(1).lower() in _SCHEMES:
                raise error(
                    field,
                    value,
                    f"a local path or a full {m.group(1)}:// URI (it would be read "
                    f"as a local directory named {m.group(1) + ':'!r})",
                    f"write {m.group(1)}://bucket/path",
                )
        return value
    from raylastic.checkpoint.backends import parse_uri  # here: imports pyarrow

    try:
        parsed = parse_uri(value)
    except ValueError as e:
        raise ConfigError(f"{field}: {e}. Fix: {fix_uri}.") from None
    if parsed.kind != "file" and any(c in _GLOB_CHARS for c in parsed.bucket + parsed.prefix):
        raise ConfigError(
            f"{field}: the path in {parsed.uri!r} contains one of {_GLOB_CHARS!r}, which "
            "object-store listings read as patterns (they would match other runs' "
            "directories). Fix: use letters, digits, '-', '_', '.' and '/'."
        )
    return value
