"""A bad command line ends in one message, not under Megatron's hundreds of lines.

Three things bury an argument error in megatron-core 0.19: ``validate_args`` prints its table of
all (some 800) arguments before it returns, and COAT's check runs after it because it needs the
values validate_args derives (``ffn_hidden_size``); argparse prints Megatron's usage (some 750
lines) above an unknown flag; and on a machine without TransformerEngine or apex, importing
megatron-core shows a dozen warnings first. ``install`` therefore:

- holds back what Python writes to stdout and stderr while ``validate_args`` runs (Megatron's,
  COAT's check, the CPU defaults) and lets it out, in order, once it returned: an argument error
  drops it and is the only thing printed;
- raises an assertion of Megatron's ``validate_args`` (or a ``ValueError`` raised in Megatron's
  code while it validates) as ``MegatronArgumentError``: Megatron's message and the line of the
  check, which ``coat-megatron-run`` prints as one line;
- gives the parser's errors without the usage, with the nearest flag for a misspelt one.

``coat-megatron-run`` also holds the warnings shown from its start (``held_output``), so those of
megatron-core's imports come out once the arguments passed, or not at all if they did not. Only
Python-level output is held: what C code writes to the file descriptors goes out at once.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import os
import sys
import traceback
import warnings
from collections.abc import Iterator

from .arguments import CoatArgumentError
from .parallel_layout import ParallelLayoutError
from .replacements import Replacements
from .run_arguments import RunArgumentError
from .version import require_megatron_core


class MegatronArgumentError(AssertionError):
    """An assertion of Megatron's ``validate_args`` failed on the command line; the message is
    Megatron's, with the line of the check."""


ARGUMENT_ERRORS = (CoatArgumentError, ParallelLayoutError, MegatronArgumentError, RunArgumentError)


class HeldOutput:
    """The hold of this process (``held_output`` makes it): warnings and, after ``hold_streams()``,
    everything written to ``sys.stdout`` / ``sys.stderr``, kept in the order written until
    ``release()`` (which writes it out) or ``discard()``."""

    def __init__(self) -> None:
        global _held
        _held = self
        self._records: list[tuple] = []
        self._showwarning = warnings.showwarning
        self._streams: dict[str, object] = {}
        warnings.showwarning = self._record_warning

    def hold_streams(self) -> None:
        if not self._streams:
            self._streams = {"stdout": sys.stdout, "stderr": sys.stderr}
            for name, stream in self._streams.items():
                setattr(sys, name, _HeldStream(self, name, stream))

    def release(self) -> None:
        for record in self._stop():
            if record[0] == "warning":
                warnings.showwarning(*record[1], **record[2])
            else:
                getattr(sys, record[0]).write(record[1])
        sys.stdout.flush()
        sys.stderr.flush()

    def discard(self) -> None:
        self._stop()

    @property
    def holding(self) -> bool:
        return _held is self

    def _stop(self) -> list[tuple]:
        global _held
        if _held is not self:
            return []
        _held = None
        if warnings.showwarning == self._record_warning:
            warnings.showwarning = self._showwarning
        for name, stream in self._streams.items():
            if isinstance(getattr(sys, name), _HeldStream):
                setattr(sys, name, stream)
        records, self._records = self._records, []
        return records

    def _record_warning(self, *args, **kwargs) -> None:
        if not self.holding:  # called through a hook that kept it (logging.captureWarnings)
            self._showwarning(*args, **kwargs)
            return
        self._records.append(("warning", args, kwargs))


class _HeldStream:
    """Stands in for ``sys.stdout`` / ``sys.stderr``: records while held, then writes through (a
    logging handler may have kept it)."""

    def __init__(self, held: HeldOutput, name: str, stream) -> None:
        self._held, self._name, self._stream = held, name, stream

    def write(self, text: str) -> int:
        if self._held.holding:
            self._held._records.append((self._name, text))
            return len(text)
        return self._stream.write(text)

    def flush(self) -> None:
        if not self._held.holding:
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


_held: HeldOutput | None = None


@contextlib.contextmanager
def held_output(*, streams: bool) -> Iterator[HeldOutput]:
    """Hold warnings (and with ``streams`` stdout and stderr) for the block or until released:
    an argument error (``ARGUMENT_ERRORS``) drops what was held, any other ending lets it out.
    Inside another hold this one joins it (holding the streams too if asked) and the outer one
    decides."""
    if _held is not None:
        if streams:
            _held.hold_streams()
        yield _held
        return
    held = HeldOutput()
    if streams:
        held.hold_streams()
    try:
        yield held
    except ARGUMENT_ERRORS:
        held.discard()
        raise
    except BaseException:
        held.release()
        raise
    held.release()


def install(replacements: Replacements) -> None:
    """Wrap ``add_megatron_arguments`` (one-line parser errors) and ``validate_args`` (output held
    until it passed) of ``megatron.training.arguments``; install after every other patch of them,
    so that the output of all of them is held."""
    require_megatron_core(__name__)
    import megatron.training.arguments as arguments

    add_megatron_arguments = arguments.add_megatron_arguments
    validate_args = arguments.validate_args

    def add_arguments_with_one_line_errors(parser):
        parser = add_megatron_arguments(parser)
        parser.error = functools.partial(_one_line_error, parser)
        return parser

    @functools.wraps(validate_args)
    def validate_args_then_print(args, defaults={}):  # noqa: B006 - Megatron's signature
        with held_output(streams=True) as held:
            try:
                result = validate_args(args, defaults)
            except ARGUMENT_ERRORS:
                raise
            except AssertionError as e:
                raise MegatronArgumentError(_assertion_message(e)) from e
            except ValueError as e:
                if not _raised_in_megatron(e):
                    raise
                raise MegatronArgumentError(_assertion_message(e)) from e
            held.release()
        return result

    replacements.replace(arguments, "add_megatron_arguments", add_arguments_with_one_line_errors)
    replacements.replace(arguments, "validate_args", validate_args_then_print)


def _raised_in_megatron(e: BaseException) -> bool:
    return f"{os.sep}megatron{os.sep}" in traceback.extract_tb(e.__traceback__)[-1].filename


def _assertion_message(e: AssertionError | ValueError) -> str:
    """Megatron's message (or, for a bare ``assert``, its condition) and where the check is."""
    frame = traceback.extract_tb(e.__traceback__)[-1]
    where = f"{frame.filename.split('site-packages' + os.sep)[-1]}:{frame.lineno}"
    return f"Megatron's validate_args refuses the arguments: {str(e) or frame.line} ({where})"


def _one_line_error(parser: argparse.ArgumentParser, message: str) -> None:
    """``parser.error`` without the usage, which for Megatron's parser runs to some 750 lines."""
    if _held is not None:
        _held.discard()
    if os.environ.get("RANK", "0") == "0":
        print(f"{parser.prog}: error: {message}{_nearest_flags(parser, message)}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _nearest_flags(parser: argparse.ArgumentParser, message: str) -> str:
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return ""
    flags = [option for option in parser._option_string_actions if option.startswith("--")]
    unknown = [word.split("=")[0] for word in message.removeprefix(prefix).split() if word.startswith("--")]
    hints = []
    for word in unknown:
        if close := difflib.get_close_matches(word, flags, n=1):
            hints.append(f"did you mean {close[0]}?" if len(unknown) == 1 else f"{word}: did you mean {close[0]}?")
    if any(word.startswith("--coat-") for word in unknown):
        hints.append("coat-megatron-run --coat-help lists the --coat-* flags")
    return f" ({' '.join(hints)})" if hints else ""
