"""Long runs: a campaign's configuration (:mod:`.config`), chunks (:mod:`.chunks`) and counts (:mod:`.records`),
the campaign engine (:mod:`.engine`), worker supervision (:mod:`.supervisor`, :mod:`.worker`,
:mod:`.worker_endings`, :mod:`.bookkeeping`; how a worker ended: :mod:`.endings`), the example database
(:mod:`.database`), reproducers (:mod:`.reproducers`), the pre-merge gate (:mod:`.gate`), relation runs
(:mod:`.relation_runs`), the report (:mod:`.report`) and Hypothesis observability (:mod:`.observability`)."""
