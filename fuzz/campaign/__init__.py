"""Long runs: the campaign engine (:mod:`.engine`), worker supervision (:mod:`.workers`), the example database
(:mod:`.database`), reproducers (:mod:`.reproducers`), the pre-merge gate (:mod:`.gate`), relation runs
(:mod:`.relation_runs`), the report (:mod:`.report`) and Hypothesis observability (:mod:`.observability`)."""
