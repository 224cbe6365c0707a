"""Project defaults from ``[tool.kvfuzz]`` in pyproject.toml, as pytest reads its ini options and Hypothesis its
profiles: the defaults a project's team shares (targets, budgets, the baseline, the output folder), so that a bare
``kvfuzz fuzz`` in the repository runs the project's campaign.

    [tool.kvfuzz]                    # every command that has the option (not bench, not replay)
    target = ["vllm.unified_attention", "vllm.cpu_attention"]
    baseline = "kvfuzz-baseline.toml"

    [tool.kvfuzz.fuzz]               # one command's own (overrides the above); [tool.kvfuzz.bench.detect] too
    duration = "5m"
    workers = 4
    out = "build/kvfuzz-out"

The file is the first pyproject.toml with a ``[tool.kvfuzz]`` table in the working directory or above it (searched
upward, like pytest's rootdir). Keys are option names without the dashes (``max-examples`` or ``max_examples``); a
repeatable option takes a list (or one value). Paths (``out``, ``baseline``, ``corpus``, a ``target`` file, ...) are
relative to the file's folder. The command line wins over the file. A key no command has, a value the option
refuses or a file that does not parse exits 2, naming the file and the key (:func:`project_defaults`; the value
errors by :func:`blame_config`, as click reports them)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import click

#: Options whose value is a path (relative to pyproject.toml's folder when set there).
PATH_KEYS = frozenset({"out", "db", "baseline", "corpus", "junit-xml", "triton-cache", "jit-cache", "json", "markdown",
                       "plot", "dir", "tree"})
#: Commands the top-level keys of [tool.kvfuzz] do not reach: the benchmarks keep their own settings (set them in a
#: [tool.kvfuzz.bench.<command>] table), and replay's options are about one reproducer (its --target is the one
#: adapter that wrote it, not the project's list).
NOT_SHARED = ("bench", "replay")


class ProjectConfig:
    """The ``[tool.kvfuzz]`` of ``path`` as click's ``default_map`` (:attr:`default_map`) and where each value came
    from (:meth:`origin`)."""

    def __init__(self, path: Path, default_map: dict, origins: dict[tuple[str, ...], str]) -> None:
        self.path, self.default_map, self._origins = path, default_map, origins

    def keys(self, command: str) -> list[str]:
        """The keys of the file that set a default of ``command`` (a subcommand of kvfuzz: "fuzz", "bench")."""
        return sorted({where.rsplit(" ", 1)[1] for c, where in self._origins.items() if c[0] == command})

    def origin(self, command: tuple[str, ...], option: str) -> str | None:
        """``"FILE [tool.kvfuzz...] key"`` for the value ``option`` (a parameter name) of ``command`` (its path
        under ``kvfuzz``, e.g. ("fuzz",)) took from the file; None if the file did not set it."""
        return self._origins.get((*command, option))


def find_pyproject(start: Path) -> Path | None:
    """The first pyproject.toml at or above ``start`` that has a ``[tool.kvfuzz]`` table (its text is looked at
    before it is parsed: a project's other pyproject.toml, even a broken one, is none of kvfuzz's business)."""
    for folder in (start, *start.parents):
        f = folder / "pyproject.toml"
        try:
            text = f.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if "[tool.kvfuzz" in text:
            return f
    return None


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    found = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            found |= _commands(cmd, (*path, name))
        else:
            found[(*path, name)] = cmd
    return found


def _option(cmd: click.Command, key: str) -> click.Option | None:
    flag = "--" + key.replace("_", "-")
    return next((p for p in cmd.params if isinstance(p, click.Option) and flag in p.opts), None)


def _value(option: click.Option, key: str, value, base: Path):
    """A TOML value as the option's default: a list for a repeatable option, paths made absolute from ``base``."""
    values = value if isinstance(value, list) else [value]
    if not option.multiple and isinstance(value, list):
        raise click.UsageError(f"takes one value, not a list ({value!r})")
    if isinstance(value, dict):
        raise click.UsageError(f"is a table; give a value ({'a list' if option.multiple else 'a string or number'})")

    def path(v):
        if not isinstance(v, str) or not v or "://" in v:
            return v
        if key == "target":  # a file's adapter: path/to/file.py:CLASS
            file, sep, cls = v.rpartition(":")
            return f"{base / file}{sep}{cls}" if file.endswith(".py") and not Path(file).is_absolute() else v
        return str(base / v) if key in PATH_KEYS and not Path(v).is_absolute() else v

    values = [path(v) for v in values]
    return values if option.multiple else values[0]


def project_defaults(group: click.Group, start: Path | None = None) -> ProjectConfig | None:
    """The project config for ``group``'s commands (``kvfuzz``), found from ``start`` (default: the working
    directory) upward; None without one. Raises click.UsageError (exit 2) naming the file and the key for a file
    that does not parse, a key no command has, a table that is not a command, or a value of the wrong shape."""
    path = find_pyproject(Path.cwd() if start is None else start)
    if path is None:
        return None
    try:
        table = tomllib.loads(path.read_text()).get("tool", {}).get("kvfuzz")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise click.UsageError(f"{path}: not valid TOML ({e}); fix it (kvfuzz reads its [tool.kvfuzz])") from None
    if not isinstance(table, dict):
        return None
    commands = _commands(group)
    default_map: dict = {}
    origins: dict[tuple[str, ...], str] = {}

    def put(cmd_path, key, value, where):
        option = _option(commands[cmd_path], key)
        try:
            converted = _value(option, key.replace("_", "-"), value, path.parent)
        except click.UsageError as e:
            raise click.UsageError(f"{path}: {where} {key}: {e.message}") from None
        node = default_map
        for part in cmd_path:
            node = node.setdefault(part, {})
        node[option.name] = converted
        origins[(*cmd_path, option.name)] = f"{path} {where} {key}"

    shared = {k: v for k, v in table.items() if not isinstance(v, dict)}
    for key, value in shared.items():
        reached = [c for c in commands if c[0] not in NOT_SHARED and _option(commands[c], key) is not None]
        if not reached:
            raise click.UsageError(f"{path}: [tool.kvfuzz] {key}: no kvfuzz command has an option --"
                                   f"{key.replace('_', '-')}; remove it, or put it in a [tool.kvfuzz.COMMAND] table")
        for c in reached:
            put(c, key, value, "[tool.kvfuzz]")
    for name, sub in _tables(table):
        where = f"[tool.kvfuzz.{'.'.join(name)}]"
        if name not in commands:
            known = ", ".join(".".join(c) for c in commands)
            raise click.UsageError(f"{path}: {where}: not a kvfuzz command; tables name one of {known}")
        for key, value in sub.items():
            if _option(commands[name], key) is None:
                raise click.UsageError(f"{path}: {where} {key}: kvfuzz {' '.join(name)} has no option --"
                                       f"{key.replace('_', '-')}")
            put(name, key, value, where)
    return ProjectConfig(path, default_map, origins)


def _tables(table: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict]]:
    """The command tables of ``[tool.kvfuzz]`` (``fuzz``, ``bench.detect``): each table whose values are not all
    tables, by its path."""
    found = []
    for k, v in table.items():
        if not isinstance(v, dict):
            continue
        scalars = {kk: vv for kk, vv in v.items() if not isinstance(vv, dict)}
        if scalars or not v:
            found.append(((*prefix, k), scalars))
        found += _tables(v, (*prefix, k))
    return found


def blame_config(error: click.UsageError, config: ProjectConfig | None) -> None:
    """Add to ``error`` (a bad value click or a command reported) where the value came from, when it came from the
    project config: "(set by FILE [tool.kvfuzz.fuzz] duration; fix it there, or give --duration)"."""
    ctx, param = error.ctx, getattr(error, "param", None)
    if config is None or ctx is None:
        return
    if param is None:  # raised in the command's body with a param_hint: "--target"
        hint = getattr(error, "param_hint", None)
        hints = [hint] if isinstance(hint, str) else list(hint or [])
        param = next((p for p in ctx.command.params if isinstance(p, click.Option) and set(p.opts) & set(hints)),
                     None)
    if param is None or ctx.get_parameter_source(param.name) is not click.core.ParameterSource.DEFAULT_MAP:
        return
    names, c = [], ctx
    while c.parent is not None:  # the command's path under kvfuzz, whatever the program was called
        names.insert(0, c.info_name)
        c = c.parent
    where = config.origin(tuple(names), param.name)
    if where is not None:
        error.message += f" (set by {where}; fix it there, or give {param.opts[0]})"


__all__ = ["NOT_SHARED", "PATH_KEYS", "ProjectConfig", "blame_config", "find_pyproject", "project_defaults"]
