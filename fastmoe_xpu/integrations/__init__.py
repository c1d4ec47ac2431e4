"""Integrations with other libraries: ``transformers`` (:func:`.transformers.patch_olmoe`) and its v4
checkpoint keys (:mod:`.v4_keys`). Nothing is imported here, so that loading one part never
imports the others (``block.py``, ``expert_weights.py`` and ``dist/sharding.py`` use ``v4_keys``;
``transformers`` uses ``block.py``)."""
