"""Coverage of all of transformers: every model type of the auto mappings, built tiny, trained
3 AdamW steps in eager and under ORTModule, compared; the report is ``docs/models.md``.

    python -m ortmodule_testing.hf_coverage --out docs/models.md
    python -m ortmodule_testing.hf_coverage --out /tmp/m.md --only llama bert --timeout 300

Needs ``transformers`` and ``ortmodule`` installed (imported when a sweep runs, not when this
package is imported). See :mod:`.shrink` (configs), :mod:`.tasks` (mappings and batches),
:mod:`.run_one` (one model type), :mod:`.sweep` (the child process), :mod:`.report`.
"""
