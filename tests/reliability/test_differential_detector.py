"""The incident soak's differential detector on its own, against senders whose behaviour is
known: one that leaks (its answer to the probe depends on what other tenants sent last), one
that is isolated (answers are a function of the request alone), one that refuses."""

from __future__ import annotations

import hashlib
import threading

from tests.reliability.incident_soak import Soak, SoakShape, Tenant, make_tenants

SHAPE = SoakShape(probe_rounds=4, traffic_per_round=2, ordinary_words=(3, 9), probe_words=50)


def _digest(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


class Pool:
    """What decode's pages hold: the texts of every ordinary request served so far."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.lock = threading.Lock()

    def isolated(self, soak: Soak, tenant: Tenant, kind: str, text: str) -> str | None:
        with self.lock:
            self.written.append(text)
        return soak.delivered(tenant, kind, _digest(text))

    def leaking(self, soak: Soak, tenant: Tenant, kind: str, text: str) -> str | None:
        with self.lock:
            if kind == "ordinary":
                self.written.append(text)
                return soak.delivered(tenant, kind, _digest(text))
            # The incident: an over-pool answer decoded over whatever the pages held.
            return soak.delivered(tenant, kind, _digest(text, *sorted(self.written)))

    def refusing(self, soak: Soak, tenant: Tenant, kind: str, text: str) -> str | None:
        if kind == "over_pool":
            soak.counts.add(over_pool_refused=1)
            return None
        return self.isolated(soak, tenant, kind, text)


def _differential(send_name: str) -> dict[str, object]:
    pool = Pool()
    soak = Soak(SHAPE, make_tenants(["a", "b", "c"]), requests_per_tenant=0)
    soak.run_differential(getattr(pool, send_name))
    return soak.counts.differential.to_json()


def test_the_detector_counts_every_round_whose_probe_output_followed_other_tenants() -> None:
    seen = _differential("leaking")
    assert seen["probe_served"] == SHAPE.probe_rounds
    assert seen["changes"] == SHAPE.probe_rounds - 1
    assert seen["distinct_outputs"] == SHAPE.probe_rounds
    assert seen["honest_changes"] == 0


def test_the_detector_reads_zero_when_answers_depend_on_the_request_alone() -> None:
    seen = _differential("isolated")
    assert seen["probe_served"] == SHAPE.probe_rounds
    assert seen["changes"] == 0 and seen["distinct_outputs"] == 1
    assert seen["honest_changes"] == 0


def test_a_refused_probe_is_never_a_change() -> None:
    seen = _differential("refusing")
    assert seen["probe_refused"] == SHAPE.probe_rounds and seen["probe_served"] == 0
    assert seen["changes"] == 0 and seen["honest_changes"] == 0
