"""The benchmark harness: the cases (:mod:`.presets`, :mod:`.cases`), the providers measured on them
(:mod:`.providers`, the ``hf_v4`` block in :mod:`.baselines`), the limits they are measured against
(:mod:`.bounds`), the timing (:mod:`.measure`, :mod:`.runner`), the outputs (:mod:`.report`) and the
cached engine choices (:mod:`.engines_cache`). ``bench/cli.py`` is its command line; the studies in
``bench/studies/`` are built on it."""
