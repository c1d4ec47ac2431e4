"""Checking a layout at scale before the allocation: the trainer's own step traced as one rank of a large
world on a fake process group (:mod:`.trace`), a step-time model over cluster files (:mod:`.model`), held
to measurements (:mod:`.calibrate`), and a layout search (:mod:`.search`). The records they share are in
:mod:`.profile`."""
