"""The help of ``coat-megatron-run``: the ``--coat-*`` flags, and why ``SCRIPT.py --help`` cannot show them.

Both texts are generated from the code: the flags from ``arguments.add_coat_arguments`` (so a new
``CoatConfig`` field is listed by itself, with its description) with each default read from ``CoatConfig``; the
reason Megatron's ``--help`` fails from Megatron's own parser, so that the launcher stops saying
so once a megatron-core release formats its help again.
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from coat_megatron.config import DEFAULT_RECIPE, CoatConfig

from .arguments import add_coat_arguments, flag


def coat_flags_help() -> str:
    """Every ``--coat-*`` flag with its meaning and default, as argparse formats a group of options.
    A help text that does not state its default gets the one a run would use appended."""
    parser = add_coat_arguments(argparse.ArgumentParser(usage=argparse.SUPPRESS, add_help=False))
    for action in parser._actions:
        if "default" not in action.help:
            action.help = f"{action.help} (default {flag_default(action)})"
    return parser.format_help().rstrip()


def flag_default(action: argparse.Action) -> str:
    """The value a run gets without the flag, as it is typed: the CoatConfig default for a knob
    (``None`` on the command line means "CoatConfig's default"), else the flag's own default."""
    name = action.dest.removeprefix("coat_")
    if name == "recipe":
        return DEFAULT_RECIPE
    if name == "expansion":  # sets m_expansion and v_expansion together
        m, v = field_default("m_expansion"), field_default("v_expansion")
        return m if m == v else f"m {m}, v {v}"
    if name in CoatConfig.__dataclass_fields__:
        return field_default(name)
    return render(action.default)


def field_default(name: str) -> str:
    """The default of CoatConfig field ``name``. A field left unset (None) resolves at construction:
    what ``CoatConfig()`` makes of it and, where switching a part off changes that, that too."""
    field = CoatConfig.__dataclass_fields__[name]
    if field.default is not None:
        return render(field.default)
    default = getattr(CoatConfig(), name)
    text = render(default)
    for part in ("optimizer", "activations"):
        try:
            other = getattr(CoatConfig(**{part: False}), name)
        except ValueError:
            continue
        if other != default:
            text += f" ({render(other)} with {flag(part)} off)"
    return text


def render(value) -> str:
    """A value as it is typed on the command line: on/off, 1/16, 16, e4m3; none."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else str(Fraction(value).limit_denominator(1 << 20))
    return str(value)


def megatron_help_failure() -> str | None:
    """Why Megatron's own ``--help`` raises instead of printing, or None where it works.

    argparse %-formats every help string (for ``%(default)s``), and a bare ``%`` in one of
    Megatron's help texts makes the whole ``--help`` raise ``ValueError``.
    """
    import megatron.core.package_info as package_info
    import megatron.training.arguments as arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    try:
        parser.format_help()
        return None
    except (ValueError, TypeError, KeyError) as e:
        error = e
    for action in parser._actions:
        try:
            (action.help or "") % dict(vars(action), prog=parser.prog)
        except (ValueError, TypeError, KeyError) as e:
            return (
                f"Megatron's own --help fails in megatron-core {package_info.__version__}: the help text of "
                f"{action.option_strings[-1]} ({action.help!r}) has a '%' that argparse's help formatting "
                f"rejects ({type(e).__name__}: {e})"
            )
    return f"Megatron's own --help fails in megatron-core {package_info.__version__}: {type(error).__name__}: {error}"
