"""A planted local module full of integer literals, imported mid-test: Hypothesis (6.131+) adds the literals of every
local module in ``sys.modules`` to a pool it draws about one choice in twenty from
(hypothesis/internal/conjecture/providers.py, ``_get_local_constants``), so importing it changes what a plain
``@seed``-ed run draws. The tests of :func:`kvfuzz.strategies.seeding.seed_only` use it to show that kvfuzz's seeded
runs do not change. Hypothesis's pool is put back as it was afterwards (through ``monkeypatch``), so the plant does
not leak into later tests' draws either."""

import importlib
import sys
import threading


def plant(tmp_path, monkeypatch, values, name: str = "kvfuzz_planted_constants"):
    """Write ``name``.py under ``tmp_path`` (no "test" in its name: Hypothesis skips test files) holding the integer
    literals ``values``, and import it; Hypothesis's pool of local constants, its cache and ``sys.modules`` are
    restored when the test ends. Returns the module."""
    from hypothesis.internal.conjecture import providers

    providers._get_local_constants()  # take in what is imported already, so the restore below keeps only that
    monkeypatch.setattr(providers, "_local_constants", providers._local_constants)
    monkeypatch.setattr(providers, "_seen_modules", set(providers._seen_modules))
    monkeypatch.setattr(providers, "_sys_modules_len", providers._sys_modules_len)
    monkeypatch.setattr(providers.CONSTANTS_CACHE, "_threadlocal", threading.local())  # its cache, emptied
    folder = tmp_path / "planted"
    folder.mkdir()
    (folder / f"{name}.py").write_text("CONSTANTS = (\n" + "".join(f"    {v},\n" for v in values) + ")\n")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    # Hypothesis rescans sys.modules only when its length changed: an earlier test's copy of this module, dropped
    # above, leaves the length as it was, so the new one would never be scanned without this
    providers._sys_modules_len = None
    return module
