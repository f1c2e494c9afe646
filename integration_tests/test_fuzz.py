"""A fixed-seed slice of the differential fuzzer through the real engine (fallback disabled).

Each program trains for three steps in eager and under ORTModule (sizes may change between
steps); loss, outputs and every gradient must match (see ortmodule_testing.fuzz.runner for the
tolerance). Programs run in a child process, so a crash fails this test with its repro instead
of ending pytest. ``nox -s fuzz`` runs thousands.

Every generated feature is on (GenConfig's defaults: data-dependent Python, linspace by shape,
input writes, loops over resized dims, vector @ batched matmul included); a seed of this slice
that hits an open bug is listed in KNOWN with the bug, and must keep failing until the fix lands
(then the entry goes). 60 programs took 46-64 s on the 2-core development machine (2026-11-26,
shared).
"""

from __future__ import annotations

from ortmodule_testing.fuzz import generate_program
from ortmodule_testing.fuzz.worker import Worker

FIRST_SEED = 0
PROGRAMS = 60

KNOWN: dict[int, str] = {
    # Not a wrong gradient, float32 rounding made chaotic: sin() of a parameter that SGD moves by
    # about 20 a step (gradients of 200). The first step's gradients agree with eager's to 2 ulp;
    # by step 2 the loss is 6e-3 from the float64 training, eager's 3e-5 (eager happens to stay
    # close). The shrunk program was as far off before size-1 input dims were fixed in the graph
    # (2026-11-26, the unshrunk one then just passed); no fix is planned: a better criterion for
    # chaotic programs is.
    48: "float32 rounding amplified by sin() of a fast-growing parameter",
}
# (seed 56, layer_norm -> sum -> sum -> where on a 0-d result, was listed here until AtenOp
# summed a gradient handed in the broadcast shape to its output's shape, 2026-11-26)


def test_fuzz_slice_matches_eager() -> None:
    outcomes = {}
    with Worker(timeout=120) as worker:
        for seed in range(FIRST_SEED, FIRST_SEED + PROGRAMS):
            outcomes[seed] = worker.run(generate_program(seed))
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    print(f"fuzz slice seeds {FIRST_SEED}..{FIRST_SEED + PROGRAMS - 1}: {counts}")
    unexpected = [
        f"seed {seed}: {o.status}\n{o.detail}\n{generate_program(seed).to_source()}"
        for seed, o in outcomes.items()
        if o.failed and seed not in KNOWN
    ]
    assert not unexpected, "\n\n".join(unexpected)
    fixed = [f"seed {s} ({why})" for s, why in KNOWN.items() if not outcomes[s].failed]
    assert not fixed, f"these programs pass now, remove them from KNOWN: {fixed}"
    assert counts.get("equal", 0) >= PROGRAMS * 3 // 4, counts  # refusals stay the exception
