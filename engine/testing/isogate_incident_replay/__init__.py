"""TEST ONLY. Replays the September 2026 incident on real SGLang 0.5.23 code.

Inactive unless ``ISOGATE_TEST_UNDO_ADMISSION_FIX=1``. When active it undoes, in
every SGLang process that loads it:

``admission``  the 0.5.23 admission fix: ``is_unadmitted_reject`` (imported by
               name into ``disaggregation/prefill.py`` ``PrefillBootstrapQueue.add``
               and ``disaggregation/decode.py`` ``DecodePreallocQueue.add``) answers
               False, so a request rejected at intake (``to_finish`` set, prompt
               replaced by a one-token stub) is bootstrapped like any other.
``retire``     prefill's retirement of a request whose abort is pending: the name
               ``is_aborted`` inside ``disaggregation/prefill.py`` only (utils and
               decode keep theirs) reads ``finished_reason`` and no longer
               ``to_finish``, so ``process_batch_result_disagg_prefill`` sends the
               stub's one-token KV and the "transfer complete" signal to decode
               instead of aborting the sender. Only the prefill module's binding
               is changed, by plain assignment, so no other module is affected.

``ISOGATE_TEST_UNDO_FIXES`` (comma-separated, default ``admission,retire``)
selects which ones; with only ``admission`` the test records what 0.5.23 does
when the admission fix alone is missing.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("isogate.incident_replay")

ACTIVATION_ENV = "ISOGATE_TEST_UNDO_ADMISSION_FIX"
FIXES_ENV = "ISOGATE_TEST_UNDO_FIXES"
ALL_FIXES = ("admission", "retire")


def selected_fixes(environ: os._Environ[str] | dict[str, str] = os.environ) -> tuple[str, ...]:
    if environ.get(ACTIVATION_ENV) != "1":
        return ()
    names = [n.strip() for n in environ.get(FIXES_ENV, ",".join(ALL_FIXES)).split(",") if n.strip()]
    unknown = sorted(set(names) - set(ALL_FIXES))
    if unknown:
        raise ValueError(f"{FIXES_ENV} names unknown fixes {unknown}; known: {list(ALL_FIXES)}")
    return tuple(names)


def never_an_unadmitted_reject(req: object) -> bool:
    """Pre-0.5.23 admission: the PD doors looked only at ``finished()``."""
    return False


def aborted_by_finished_reason_only(req: object) -> bool:
    """Prefill's abort test without the pending-abort (``to_finish``) half."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(getattr(req, "finished_reason", None), FINISH_ABORT)


def register() -> None:
    fixes = selected_fixes()
    if not fixes:
        return
    if "admission" in fixes:
        # The importers must be loaded for the registry to rebind their names.
        import sglang.srt.disaggregation.decode
        import sglang.srt.disaggregation.prefill  # noqa: F401
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        # REPLACE on the defining module; SGLang's registry rebinds the names
        # that prefill.py and decode.py imported from it.
        HookRegistry.register(
            "sglang.srt.disaggregation.utils.is_unadmitted_reject",
            never_an_unadmitted_reject,
            HookType.REPLACE,
        )
    if "retire" in fixes:
        import sglang.srt.disaggregation.prefill as prefill

        prefill.is_aborted = aborted_by_finished_reason_only
    logger.warning(
        "isogate-incident-replay: TEST ONLY, undoing SGLang fixes %s in this process", list(fixes)
    )
