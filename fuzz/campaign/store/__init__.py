"""What a campaign keeps on disk and reads back: :mod:`.database` (the Hypothesis example database: a directory,
Redis, a read-only view), :mod:`.journal` (atomic writes, tolerant reads, the ``--out`` lock, a full disk,
state.json), :mod:`.reproducers` (writing a reproducer directory), :mod:`.cases` (reading one back, validated),
:mod:`.baseline` (the findings baseline a team accepted) and :mod:`.report` (report.md from summary.json). It
imports nothing else of the campaign room. Import from the modules; the package itself exports nothing."""

__all__: list[str] = []
