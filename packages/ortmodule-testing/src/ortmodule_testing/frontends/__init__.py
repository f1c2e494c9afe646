"""The two exporter frontends side by side: ``docs/frontends.md`` and ``docs/frontends.json``.

    python -m ortmodule_testing.frontends                    # every suite, both frontends
    python -m ortmodule_testing.frontends --parts timing     # one suite, merged into the JSON
    python -m ortmodule_testing.frontends --render-only      # the page from the JSON only

Each suite runs once per frontend (``ORTMODULE_EXPORTER=torchscript`` and ``torch_export``),
in child processes with the variable set, with ``ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE``:

- ``zoo``: ``packages/ortmodule/tests/test_zoo_parity.py`` under pytest, every test's outcome;
- ``hf``: a fixed sample of Hugging Face model types through
  ``python -m ortmodule_testing.hf_coverage`` (every k-th of the types that train in eager in
  ``docs/models.jsonl``, sorted);
- ``opinfo``: PyTorch's OpInfo ops through ``packages/ortmodule/tests/opinfo_sweep.py`` (every
  k-th op, sorted, or all of them); the TorchScript side may be the committed
  ``opinfo_status.json`` instead of a run, which the page then says;
- ``fuzz``: the differential fuzzer's programs of the same seeds (no shrinking);
- ``timing``: export, first-step and median step time of zoo models, one fresh process per
  frontend and model.

The JSON holds every per-item result; the page is :func:`~.render.render` of it and nothing else
(``packages/ortmodule-testing/tests/test_frontends_doc.py`` checks that it is).
"""

FRONTENDS = ("torchscript", "torch_export")

__all__ = ["FRONTENDS"]
