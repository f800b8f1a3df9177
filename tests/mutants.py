"""Break the lifecycle on purpose, one rule at a time, and check the tests notice.

Each mutant is one small edit to the package that re-creates one of the failures listed in
``docs/failures.md`` (named by its number). Its *killers* are the tests that must fail
against a copy of the package with that edit; a mutant that leaves them green means a rule has
no test that would fail without it. Running only the killers keeps this fast enough for CI.

``python tests/mutants.py`` (``nox -s mutants``, run by CI) runs every mutant against its
killers and exits non-zero if any survives. ``python tests/mutants.py --broad`` runs each
against the whole lifecycle suite and lists every test that kills it, to choose killers from.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROAD = (
    "tests/test_scope_invariants.py",
    "tests/test_scope_catches_naive.py",
    "tests/test_service_shutdown.py",
    "tests/test_registration_ledger.py",
    "tests/test_explore.py",
    "tests/test_scope_faults.py",
)
INVARIANTS = "tests/test_scope_invariants.py::"
FAULTS = "tests/test_scope_faults.py::"
EXPLORE = "tests/test_explore.py::"
HELD = "tests/test_scope_held_memory.py::"
STATE = "tests/test_request_state.py::"
VIDEO = "tests/test_encoder_vlm_video.py::"
PARTS = "tests/test_encoder_video_parts.py::"
KEEP = "tests/test_encoder_keeping_modalities.py::"
SQUARE = "tests/test_encoder_vlm_video_square.py::"
PAUSED = (
    "tests/test_scope_held_memory_mooncake.py::"
    "test_a_paused_rank_receives_its_own_bytes_when_it_resumes_never_the_next_requests"
)


@dataclass(frozen=True)
class Mutant:
    """An edit of ``file`` (under src/trio_encode) and the tests that must catch it."""

    file: str
    old: str
    new: str
    killers: tuple[str, ...]
    also: tuple[tuple[str, str, str], ...] = ()
    """Further ``(file, old, new)`` edits, for a rule that two parts of the code enforce."""

    def edits(self) -> tuple[tuple[str, str, str], ...]:
        return ((self.file, self.old, self.new), *self.also)


MUTANTS: dict[str, Mutant] = {
    "siblings each register (failure 1)": Mutant(
        "scope.py",
        "            if self._leases is None:\n                try:",
        "            if True:\n                try:",
        (
            INVARIANTS + "test_sibling_sends_register_once",
            EXPLORE + "test_random_schedules_without_cancellation",
        ),
    ),
    "requests sharing memory each register (failure 10)": Mutant(
        "ledger.py",
        "            if region is None:\n                return await self._register",
        "            if True:\n                return await self._register",
        (
            INVARIANTS + "test_two_requests_sharing_memory_register_it_once",
            EXPLORE + "test_random_schedules_without_cancellation",
        ),
    ),
    "embedding dropped before deregistration (failure 2)": Mutant(
        # The scope drops it last, and the ledger keeps it while registered: break both.
        "scope.py",
        "        leases, self._leases = self._leases or [], None\n",
        "        leases, self._leases = self._leases or [], None\n        self._embedding = None\n",
        (
            INVARIANTS + "test_embedding_is_dropped_only_after_deregistration",
            EXPLORE + "test_random_schedules_without_cancellation",
        ),
        also=(
            (
                "ledger.py",
                "        region = _Region(address, length, owners=[owner])",
                "        region = _Region(address, length)",
            ),
            (
                "ledger.py",
                "            region.owners.append(owner)\n",
                "            pass\n",
            ),
        ),
    ),
    "transfer errors swallowed (failure 3)": Mutant(
        "scope.py",
        "        except EngineError as exc:\n            if exc.call",
        "        except BaseException:\n            pass\n        except EngineError as exc:\n"
        "            if exc.call",
        (INVARIANTS + "test_transfer_error_is_raised_with_its_code",),
    ),
    "transfer runs in the handler, not the scope (failure 6)": Mutant(
        "scope.py",
        "            self._nursery.start_soon(self._run_attempt, attempt)\n"
        "        attempt.waiters += 1",
        "            attempt.waiters += 1\n            await self._run_attempt(attempt)\n"
        "        else:\n            attempt.waiters += 1",
        (INVARIANTS + "test_scope_waits_for_a_transfer_stuck_in_its_thread",),
    ),
    "cleanup not shielded (failure 6)": Mutant(
        "scope.py",
        "            with trio.CancelScope(shield=True):\n                await self._release()",
        "            if True:\n                await self._release()",
        (INVARIANTS + "test_cancelling_the_service_nursery_still_deregisters",),
    ),
    "retry counted as a new receiver (failure 7)": Mutant(
        "request_state.py",
        "        self.done.add(receiver)",
        "        self.done.add(Receiver(receiver.session_id, -len(self.done) - 1))",
        (INVARIANTS + "test_retry_from_the_same_receiver_is_not_a_new_receiver",),
    ),
    "failed encode leaves the scope open (failure 8)": Mutant(
        "scope.py",
        '            self._finish("encode_failed", Failure(EncodeFailed, f"the encoder failed: '
        '{exc}"))\n        else:',
        "            pass\n        else:",
        (INVARIANTS + "test_failed_encode_answers_every_waiting_sender",),
    ),
    "disconnected client's send still starts (invariant 7)": Mutant(
        "scope.py",
        "                attempt.withdraw.cancel()",
        "                pass",
        (INVARIANTS + "test_client_disconnect_before_its_transfer_starts_withdraws_it",),
    ),
    "lease granted on a region still registering": Mutant(
        "ledger.py",
        '            if region.state in ("registering", "deregistering"):',
        '            if region.state == "deregistering":',
        (
            "tests/test_registration_ledger.py::test_lease_waits_for_a_region_still_registering",
            EXPLORE + "test_random_schedules_without_cancellation",
        ),
    ),
    "lease granted on a region being deregistered": Mutant(
        "ledger.py",
        '            if region.state in ("registering", "deregistering"):',
        '            if region.state == "registering":',
        ("tests/test_registration_ledger.py::test_lease_waits_for_a_region_being_deregistered",),
    ),
    "a lease spins on a region being deregistered": Mutant(
        "ledger.py",
        "        region.settled = trio.Event()  # a fresh one",
        "        pass  # a fresh one",
        ("tests/test_registration_ledger.py::test_lease_waiting_for_a_deregistration_blocks",),
    ),
    "a withdrawn send still transfers (failure 11)": Mutant(
        # Once registered, a send counted as transferring while it waited for a thread.
        "scope.py",
        "            if attempt.waiters == 0 and not (attempt.done.is_set() or attempt.submitted",
        "            if attempt.waiters == 0 and not self._leases and not (attempt.done.is_set()"
        " or attempt.submitted",
        (
            FAULTS + "test_a_send_waiting_for_a_thread_is_withdrawn_when_its_client_leaves",
            FAULTS + "test_a_withdrawn_send_never_writes_after_its_retry_answered",
        ),
    ),
    "a scope opens inside its opener's cancellation (failure 12)": Mutant(
        "scopes.py",
        "        with trio.CancelScope(shield=True):\n            await self._nursery.start",
        "        if True:\n            await self._nursery.start",
        (FAULTS + "test_an_openers_disconnect_does_not_end_the_request_for_its_siblings",),
    ),
    "a frozen rank may hold every transfer thread (failure 13)": Mutant(
        "engine/threads.py",
        "self.settings.sends_per_session),",
        "1_000_000),",
        (FAULTS + "test_a_frozen_rank_parks_only_its_own_sends",),
    ),
    "a frozen node may hold every transfer thread (failure 13)": Mutant(
        "engine/threads.py",
        "self.settings.sends_per_host),",
        "1_000_000),",
        (FAULTS + "test_a_frozen_node_leaves_the_threads_another_node_needs",),
    ),
    "a receiver's bound is never forgotten (failure 13)": Mutant(
        "engine/threads.py",
        "        if _in_use(limiter) == 0:\n            limiters.pop(key, None)",
        "        if False:\n            limiters.pop(key, None)",
        (FAULTS + "test_a_frozen_node_leaves_the_threads_another_node_needs",),
    ),
    "a refused submission does not end the write": Mutant(
        "engine/mooncake.py",
        "            code = TRANSFER_FAILED\n            break",
        "            code = TRANSFER_FAILED\n            continue",
        ("tests/test_engine_polling.py::test_a_refused_submission_ends_the_write",),
    ),
    "batches the engine stopped waiting for are forgotten (failure 19)": Mutant(
        "engine/mooncake.py",
        "        if pending:\n            self._abandoned.append(",
        "        if False:\n            self._abandoned.append(",
        (PAUSED,),
    ),
    "a receiver frozen at first contact stalls the engine (failure 23)": Mutant(
        "engine/mooncake.py",
        "        if session_id not in self._contacted:\n            await self._first_contact",
        "        if False:\n            await self._first_contact",
        (
            "tests/test_process_faults.py::"
            "test_a_peer_frozen_at_first_contact_fails_alone_after_its_probe",
        ),
    ),
    "a 503 from the encoder is remembered (failure 14)": Mutant(
        "scope.py",
        'self._finish("refused", Failure.of(exc))',
        'self._finish("encode_failed", Failure.of(exc))',
        (FAULTS + "test_a_transient_refusal_leaves_nothing_behind",),
    ),
    "a second shutdown request restarts the grace (failure 15)": Mutant(
        "service/core.py",
        "        if self.registry.closed:\n            self.end_grace()",
        "        if self.shutdown_report is not None:\n            return self.shutdown_report\n"
        "        if False:\n            self.end_grace()",
        (FAULTS + "test_interrupting_shutdown_cuts_the_grace_short",),
    ),
    "an unexpected error escapes its request (failure 16)": Mutant(
        "scope.py",
        "        except Exception as exc:\n            self._fail_unexpectedly(exc)\n"
        "        finally:\n            if not attempt",
        "        finally:\n            if not attempt",
        (FAULTS + "test_an_unexpected_error_ends_only_its_own_request",),
    ),
    "a failed deregistration frees the memory (failure 17)": Mutant(
        "ledger.py",
        "            else:\n                self._quarantine(region)\n            raise",
        "            else:\n                self._forget(region)\n            raise",
        (
            FAULTS + "test_a_failed_deregistration_keeps_the_memory_until_a_retry_succeeds",
            EXPLORE + "test_random_schedules_with_engine_faults",
        ),
    ),
    "a served rank's lost answer becomes a 410 (failure 18)": Mutant(
        "request_state.py",
        "        if again is not None:\n            return again\n",
        "        if False:\n            return again\n",
        (
            FAULTS + "test_a_served_receiver_that_retries_after_completion_gets_its_answer_again",
            STATE + "test_a_served_receiver_gets_its_answer_again_and_any_other_the_end",
        ),
    ),
    "the last end reason rewrites the first": Mutant(
        "request_state.py",
        "        if self.reason is None:\n            self.reason = reason",
        "        if True:\n            self.reason = reason",
        (
            STATE + "test_the_first_end_reason_and_failure_stand",
            INVARIANTS + "test_after_every_scope_ends_nothing_is_held",
        ),
    ),
    "a bad input's tombstone refuses the corrected /encode": Mutant(
        "request_state.py",
        "    if ended is not None and not (ended.gone and ended.reason in RETRIABLE):",
        "    if ended is not None:",
        (
            STATE + "test_a_remembered_bad_input_is_not_held_against_a_corrected_encode",
            INVARIANTS + "test_registry_rules",
        ),
    ),
    "the tombstone limit forgets the newest ended request": Mutant(
        "recent.py",
        "            self._entries.popitem(last=False)",
        "            self._entries.popitem(last=True)",
        (
            "tests/test_scope_holds.py::test_the_tombstone_limit_forgets_the_oldest_ended_request",
            "tests/test_recent.py::test_the_oldest_entry_goes_first_past_the_limit",
        ),
    ),
    "a failover sends into the slot the first encoder may still write (failure 21)": Mutant(
        "client/fleet.py",
        "                        slot.quarantine()\n                        slot = None\n",
        "",
        (
            "tests/test_client_fleet.py::"
            "test_a_failover_lands_in_a_fresh_slot_while_the_first_encoder_still_writes",
        ),
    ),
    "a store put reads a segment it does not hold (failure 20)": Mutant(
        "encoder/keeping.py",
        "            segment.arena.lease(segment)\n            done = partial(",
        "            done = None and partial(",
        ("tests/test_encoder_store.py::test_a_pending_store_put_keeps_its_segment_from_reuse",),
    ),
    "memory a transfer given up on may read is reused (failure 19)": Mutant(
        "ledger.py",
        "        if not any(self._engine.reading(lease.address, lease.length) for lease in "
        "leases):",
        "        if True:",
        (
            HELD + "test_an_arena_segment_read_by_a_transfer_given_up_on_is_never_reused",
            HELD + "test_a_registration_read_by_a_transfer_given_up_on_stays_until_it_fails",
            PAUSED,
        ),
    ),
    "a poisoned kept row served, in the arena or in plain memory (failure 24)": Mutant(
        "encoder/keeping.py",
        "        kept.checksum is not None and tensor_checksum(kept.row) == kept.checksum for kept",
        "        True for kept",
        (
            "tests/test_http_security.py::"
            "test_an_engine_write_into_the_arena_is_detected_and_never_served",
            "tests/test_http_security.py::"
            "test_an_engine_write_into_a_registered_cached_row_is_never_served",
            "tests/test_encoder_store_late_cache_row.py::"
            "test_a_cache_row_found_after_a_store_miss_is_verified_before_it_is_served",
            "tests/test_encoder_keeping.py::"
            "test_an_overwritten_arena_segment_is_dropped_and_encoded_again",
            "tests/test_encoder_keeping.py::"
            "test_an_overwritten_cached_row_is_dropped_and_encoded_again",
        ),
    ),
    "the arena's records of kept rows grow with every image ever seen": Mutant(
        "encoder/keeping.py",
        "        if len(self._written) > 2 * len(self.arena) + 16:",
        "        if False:",
        ("tests/test_encoder_keeping.py::test_the_arena_records_are_pruned_as_the_arena_evicts",),
    ),
    "a poisoned Mooncake Store entry served (failure 24)": Mutant(
        "encoder/store.py",
        "                        sealed = checksum == _stored_checksum(digest)",
        "                        sealed = True",
        (
            "tests/test_http_security.py::"
            "test_a_store_entry_whose_bytes_were_overwritten_is_never_served",
            KEEP
            + "test_a_row_rewritten_beside_its_own_digest_and_description_is_never_served[unkeyed]",
        ),
    ),
    "a store entry not sealed with the fleet's secret served": Mutant(
        "encoder/store.py",
        "sealed = hmac.compare_digest(seal.digest(key, row), stored)",
        "sealed = True",
        (
            "tests/test_encoder_store_key.py::"
            "test_with_a_fleet_secret_only_entries_sealed_by_the_fleet_are_served",
            KEEP
            + "test_a_row_rewritten_beside_its_own_digest_and_description_is_never_served[keyed]",
        ),
    ),
    "a row changed since its forward sealed as the fleet's": Mutant(
        "encoder/store.py",
        "                    if tensor_checksum(tensor) != _stored_checksum(digest):",
        "                    if False:",
        ("tests/test_encoder_store_key.py::test_a_row_changed_since_its_forward_is_never_sealed",),
    ),
    "rows sent as they lie give their arena leases back before the send": Mutant(
        "encoder/keeping.py",
        "        embedding = RowsEmbedding(rows, grids, leases=held, media=media)",
        "        embedding = RowsEmbedding(rows, grids, media=media)",
        (
            "tests/test_encoder_arena.py::"
            "test_a_row_sent_as_it_lies_in_the_arena_keeps_its_segment_until_released",
        ),
        also=(
            (
                "encoder/front.py",
                "            handed_over = True  # the arena leases of the rows that lie there",
                "            handed_over = False  # the arena leases of the rows that lie there",
            ),
        ),
    ),
    "a client that leaves withdraws a submitted send (failure 11)": Mutant(
        # The engine stops waiting for a withdrawn transfer; its retry writes a second time.
        "scope.py",
        "not (attempt.done.is_set() or attempt.submitted.is_set()):",
        "not attempt.done.is_set():",
        (FAULTS + "test_a_submitted_send_is_not_withdrawn_by_a_client_that_leaves",),
    ),
    "memory held at shutdown is freed with the service (failure 19)": Mutant(
        "ledger.py",
        "            _KEPT_UNTIL_EXIT.extend(self._held)",
        "            pass",
        (
            "tests/test_service_shutdown.py::"
            "test_shutdown_waits_for_held_transfers_and_keeps_what_is_still_read",
        ),
    ),
    "one exception raised in every waiter of a send (failure 22)": Mutant(
        "scope.py",
        "            raise attempt.error.fresh()",
        "            raise attempt.error",
        ("tests/test_scope_holds.py::test_a_retry_joining_a_failing_send_raises_its_own_error",),
    ),
    "Mooncake's own timeout status taken for an end (failure 19)": Mutant(
        "engine/mooncake.py",
        "        elif status != DONE:\n            still.append(check)",
        "        elif status == 0:\n            still.append(check)",
        ("tests/test_engine_polling.py::test_mooncakes_own_timeout_status_is_not_an_end",),
    ),
    "error pushes take any socket (hostile)": Mutant(
        "completion/pusher.py",
        '            if kind == "error":\n                async with self._error_slots:',
        "            if False:\n                async with self._error_slots:",
        (
            "tests/test_completion_pusher.py::test_error_pushes_to_gone_hosts_never_take_the_so"
            "ckets_done_pushes_need",
        ),
    ),
    "a failure pushed to an endpoint its request never bound (hostile)": Mutant(
        "service/messages.py",
        "        elif only in record.endpoints and only not in record.told:",
        "        elif only not in record.told:",
        (
            "tests/test_service_completion.py::test_failure_pushes_go_only_to_endpoints_of_requ"
            "ests_this_server_holds",
        ),
    ),
    "endpoints uncapped across joins (hostile)": Mutant(
        "service/requests.py",
        "    if len(named) <= MAX_ENDPOINTS - len(bound):\n        return",
        "    if True:\n        return",
        ("tests/test_service_completion.py::test_joins_cannot_bind_more_endpoints_than_the_cap",),
    ),
    # What a hostile or careless client sends: each containment and bound.
    "a connection's failure reaches the server's nursery (hostile)": Mutant(
        "server/connections.py",
        "    except* Exception as group:",
        "    except* KeyError as group:",
        (
            "tests/test_server_connections.py::"
            "test_a_connection_whose_server_task_raises_ends_alone",
        ),
    ),
    "part numbers unbounded (hostile)": Mutant(
        "server/schemas.py",
        "PartIndex = Annotated[StrictInt, Field(ge=0, lt=MAX_PARTS)]",
        "PartIndex = Annotated[StrictInt, Field(ge=0)]",
        (
            "tests/test_http_bad_input.py::test_bad_input_gets_a_contract_error_and_leaves_noth"
            "ing[send-part-idx-huge]",
        ),
    ),
    "bodies in flight unbounded (hostile)": Mutant(
        "server/app.py",
        "        if self.held + nbytes > self.budget or 2 *",
        "        if False and 2 *",
        (
            "tests/test_server_connections.py::"
            "test_bodies_in_flight_share_one_budget_and_one_client_holds_half",
        ),
    ),
    "a client's string echoed whole (hostile)": Mutant(
        "errors.py",
        "        if len(message) > MAX_MESSAGE_CHARS:",
        "        if False:",
        (
            "tests/test_http_bad_input.py::test_bad_input_gets_a_contract_error_and_leaves_noth"
            "ing[modality-huge]",
        ),
        also=(("errors.py", "    if len(value) <= QUOTED_CHARS:", "    if True:"),),
    ),
    "JPEG scans unbounded (hostile)": Mutant(
        "encoder/image_scan.py",
        "        if len(starts) > MAX_JPEG_SCANS:",
        "        if False:",
        (
            "tests/test_encoder_image_bounds.py::test_a_jpeg_of_thousands_of_scans_is_refused_b"
            "efore_decoding",
        ),
    ),
    "PNG chunks unbounded (hostile)": Mutant(
        "encoder/image_scan.py",
        '            if chunks > MAX_CHUNKS:\n                raise _over("PNG chunks',
        '            if False:\n                raise _over("PNG chunks',
        (
            "tests/test_encoder_image_bounds.py::test_a_png_of_a_million_empty_chunks_is_refuse"
            "d_before_decoding",
        ),
    ),
    "a poller that never wakes a send whose batches ended (isolation)": Mutant(
        "engine/mooncake.py",
        "        if not flight.batches:\n            return outcome.Value((flight.code, []))",
        "        if False:\n            return outcome.Value((flight.code, []))",
        ("tests/test_engine_poller.py::test_the_poller_wakes_each_send_when_its_own_batches_end",),
    ),
    "a poller that forgets an abandoned batch (failure 19)": Mutant(
        "engine/mooncake.py",
        "            return outcome.Value((flight.code or TRANSFER_FAILED, flight.batches))",
        "            return outcome.Value((flight.code or TRANSFER_FAILED, []))",
        (
            "tests/test_engine_poller.py::test_a_cancelled_send_leaves_at_once_and_its_batches_"
            "stay_reading",
        ),
    ),
    "a poller that ignores a cancelled caller (isolation)": Mutant(
        "engine/mooncake.py",
        "        if waited > flight.timeout or flight.stop.is_set():",
        "        if waited > flight.timeout:",
        (
            "tests/test_engine_poller.py::test_a_cancelled_send_leaves_at_once_and_its_batches_"
            "stay_reading",
        ),
    ),
    "a transfer holds its thread while it waits (isolation)": Mutant(
        "engine/mooncake.py",
        "        code, batches, nbytes = submit_segments(self.raw, write, flight.stop)\n",
        "        code, batches, nbytes = submit_segments(self.raw, write, flight.stop)\n"
        "        wait_until_done(list(batches), transfer_timeout(nbytes), stop=flight.stop)\n",
        ("tests/test_engine_poller.py::test_sends_parked_on_frozen_receivers_hold_no_thread",),
    ),
    "the poller not woken for a new transfer (isolation)": Mutant(
        "engine/mooncake.py",
        "        if flight.due < self._wake_at:\n            self.wake()",
        "        if False:\n            self.wake()",
        ("tests/test_engine_poller.py::test_sends_parked_on_frozen_receivers_hold_no_thread",),
    ),
    "one client's share of transfers unchecked (isolation)": Mutant(
        "settings.py",
        "        if 2 * self.max_sends_per_client > cap:",
        "        if False:",
        (
            "tests/test_client_share.py::test_a_client_s_share_is_at_most_half_the_engine_s_tra"
            "nsfers",
        ),
    ),
    "no engine-wide cap on transfers in flight (isolation)": Mutant(
        "engine/threads.py",
        "        self.in_flight = trio.CapacityLimiter(self.settings.transfers_in_flight)",
        "        self.in_flight = trio.CapacityLimiter(1_000_000)",
        (
            "tests/test_isolation_mock_clock.py::test_the_engine_bounds_transfers_in_flight_on_"
            "the_mock_clock",
        ),
    ),
    "concurrent first sends each probe (isolation)": Mutant(
        "engine/mooncake.py",
        "        probe = self._probing.get(session_id)",
        "        probe = None",
        (
            "tests/test_isolation_processes.py::test_many_sends_to_a_rank_frozen_before_first_c"
            "ontact_leave_new_ranks_served",
        ),
    ),
    "an error kind's documented status drifts (docs)": Mutant(
        "errors.py",
        "    status = 415",
        "    status = 400",
        (
            "tests/test_docs_consistency.py::test_every_error_kind_the_docs_name_exists_with_it"
            "s_status",
        ),
    ),
    "a metric the dashboard queries is renamed (docs)": Mutant(
        "server/metrics.py",
        "    held_transfer_bytes = _Metric(Gauge)",
        "    held_bytes = _Metric(Gauge)",
        ("tests/test_deploy.py::test_every_dashboard_query_names_only_what_the_server_exports",),
    ),
    "the default port drifts from the probes' (docs)": Mutant(
        "settings.py",
        "    port: int = server_setting(8000, ge=0, le=65535)",
        "    port: int = server_setting(8080, ge=0, le=65535)",
        ("tests/test_deploy.py::test_the_manifest_wires_the_probes_to_the_real_routes_and_port",),
    ),
    "the ready line before the warm-up (first hour)": Mutant(
        "server/loading.py",
        "            await nursery.start(encoder.run)\n",
        "            nursery.start_soon(encoder.run)\n",
        (
            "tests/test_first_hour.py::test_the_ready_line_comes_after_serving_on_and_the_first"
            "_request_after_it_is_served",
        ),
    ),
    "a config-only model directory accepted (first hour)": Mutant(
        "encoder/hf.py",
        "    if not files:\n",
        "    if False:\n",
        (
            "tests/test_first_hour.py::test_a_model_directory_the_loader_would_fail_on_is_refus"
            "ed_before_listening",
        ),
    ),
    "rdma without devices accepted (first hour)": Mutant(
        "engine/rdma_devices.py",
        "    if not found:\n",
        "    if False:\n",
        (
            "tests/test_first_hour.py::test_rdma_is_refused_without_devices_and_named_devices_m"
            "ust_exist",
        ),
    ),
    "--dtype auto ignores the model's config (first hour)": Mutant(
        "encoder/settings.py",
        '        return config_dtype(self.model / "config.json")\n',
        '        return "float32"\n',
        ("tests/test_first_hour.py::test_dtype_auto_is_the_model_directory_s_own",),
    ),
    "errors name the setting, not the flag typed (first hour)": Mutant(
        "options.py",
        "    return named[flat] if flat in named else describe(loc)\n",
        "    return describe(loc)\n",
        (
            "tests/test_first_hour.py::test_an_error_names_the_flag_or_the_variable_the_value_c"
            "ame_from",
        ),
    ),
    "progress cut off a terminal (first hour)": Mutant(
        "tools/progress.py",
        "        self._plain = enabled and not self._console.is_terminal\n",
        "        self._plain = False\n",
        ("tests/test_first_hour.py::test_progress_off_a_terminal_is_whole_plain_lines",),
    ),
    "receive reports a landing with a hole (first hour)": Mutant(
        "tools/receive.py",
        "        if len(written) != last_word + 1:\n            return None\n",
        "",
        ("tests/test_receive.py::test_a_landing_is_the_run_up_to_the_last_byte_no_longer_fill",),
    ),
    "a fast route skips the token (hot path)": Mutant(
        "server/app.py",
        "        if self.expected is None or path not in _PROTECTED:",
        "        if True:",
        (
            "tests/test_server_fast_routes.py::test_the_fast_routes_answer_log_and_count_exactl"
            "y_as_quart_does",
        ),
    ),
    "a declared control body past its limit is read (hostile)": Mutant(
        "server/app.py",
        "        if declared and limit is not None and declared > limit:\n"
        "            scope[_CUT] = True\n        elif declared:",
        "        if declared:",
        (
            "tests/test_server_fast_routes.py::"
            "test_a_control_body_declared_past_its_limit_is_cut_before_a_byte_is_read",
            "tests/test_server_fast_routes.py::test_the_fast_routes_answer_log_and_count_exactl"
            "y_as_quart_does",
        ),
    ),
    "Quart reads a control body already cut (hostile)": Mutant(
        "server/app.py",
        "        if not request.scope.get(_CUT):  # a body cut before a byte was read has none to "
        "read\n            data =",
        "        if True:\n            data =",
        (
            "tests/test_server_fast_routes.py::test_the_fast_routes_answer_log_and_count_exactl"
            "y_as_quart_does",
        ),
    ),
    "a kept send error holds the frames of its raise": Mutant(
        "scope.py",
        "    error.__traceback__ = None\n    error.__context__ = None",
        "    error.__context__ = None",
        (EXPLORE + "test_random_schedules_with_engine_faults",),
    ),
    "Qwen3-VL-MoE sent without its deepstack layers": Mutant(
        "encoder/vlm.py",
        '    "qwen3_vl_moe": _DEEPSTACK,\n',
        '    "qwen3_vl_moe": _QWEN,\n',
        (
            "tests/test_encoder_vlm.py::test_served_bytes_equal_transformers_and_counts_equal_t"
            "he_prompt[qwen3_vl_moe-float32]",
        ),
    ),
    "the deepstack width read from one model type": Mutant(
        "encoder/vlm.py",
        "        if self.family.deepstack:\n",
        '        if model_type == "qwen3_vl":\n',
        (
            "tests/test_encoder_vlm.py::test_served_bytes_equal_transformers_and_counts_equal_t"
            "he_prompt[qwen3_vl_moe-float32]",
        ),
    ),
    "Qwen3.5 given a deepstack it does not have": Mutant(
        "encoder/vlm.py",
        '    "qwen3_5": _QWEN,\n',
        '    "qwen3_5": _DEEPSTACK,\n',
        (
            "tests/test_encoder_vlm.py::test_served_bytes_equal_transformers_and_counts_equal_t"
            "he_prompt[qwen3_5-float32]",
        ),
    ),
    "Gemma 4's padding patches served as real ones": Mutant(
        "encoder/vlm.py",
        "packed[..., -2:].to(torch.long)",
        "packed[..., -2:].to(torch.long).clamp(min=0)",
        (
            "tests/test_encoder_vlm.py::test_served_bytes_equal_transformers_and_counts_equal_t"
            "he_prompt[gemma4-float32]",
        ),
    ),
    "a served family without a tiny model": Mutant(
        "testing/tiny_vlm.py",
        '    "gemma4": "Gemma 4",\n',
        "",
        ("tests/test_tiny_model.py::test_every_served_vlm_family_has_a_tiny_model",),
    ),
    "SGLang's frame resize not rounded": Mutant(
        "encoder/vlm_video.py",
        "= torch.round(chunk).to(torch.uint8)",
        "= chunk.to(torch.uint8)",
        (VIDEO + "test_each_resize_gives_torchvisions_bytes[sglang_down]",),
    ),
    "SGLang's frame resize not antialiased": Mutant(
        "encoder/vlm_video.py",
        '            mode="bilinear",\n'
        "            align_corners=False,\n"
        "            antialias=True,",
        '            mode="bilinear",\n'
        "            align_corners=False,\n"
        "            antialias=False,",
        (VIDEO + "test_each_resize_gives_torchvisions_bytes[sglang_down]",),
    ),
    "a frame's share of the video's pixels ignored": Mutant(
        "encoder/vlm_video.py",
        "min(pixels.max_pixels, pixels.total_pixels / frames * FRAME_FACTOR)",
        "pixels.max_pixels",
        (VIDEO + "test_sglangs_frame_size[720-1280-768-size3]",),
    ),
    "SGLang's pixel floor dropped": Mutant(
        "encoder/vlm_video.py",
        "        int(pixels.min_pixels * 1.05),\n",
        "        0,\n",
        (VIDEO + "test_sglangs_pixel_floor_bounds_the_longest_videos",),
    ),
    "Qwen3-VL's frame-counting rule applied per frame": Mutant(
        "encoder/vlm_video.py",
        "count, t_bar = frames, round(frames / temporal) * temporal",
        "count, t_bar = 1, 1",
        (VIDEO + "test_the_processors_own_rule_counts_frames_for_qwen3_only",),
    ),
    "the video processor not inferred from the image processor": Mutant(
        "encoder/vlm_video.py",
        "        if image and _transformers_has(inferred):",
        "        if False:",
        (VIDEO + "test_pixels_are_the_processors_recorded_ones[qwen3_vl]",),
    ),
    "the bicubic resize run through float": Mutant(
        "encoder/vlm_video.py",
        'if mode == "bicubic" or native_uint8_bilinear():',
        'if mode == "bilinear" and native_uint8_bilinear():',
        (VIDEO + "test_each_resize_gives_torchvisions_bytes[bicubic]",),
    ),
    "the processor's resize not antialiased": Mutant(
        "encoder/vlm_video.py",
        "mode=mode, align_corners=False, antialias=True)",
        "mode=mode, align_corners=False, antialias=False)",
        (VIDEO + "test_each_resize_gives_torchvisions_bytes[bicubic]",),
    ),
    "video frames normalised otherwise than transformers does": Mutant(
        "encoder/vlm_video.py",
        "return out.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))",
        "return out.sub_(mean.view(-1, 1, 1)).mul_(1 / std.view(-1, 1, 1))",
        (VIDEO + "test_pixels_are_the_processors_recorded_ones[qwen2_vl]",),
    ),
    "an odd last frame padded with zeros": Mutant(
        "encoder/vlm_video.py",
        "frames[-1:].expand(pad, -1, -1, -1)",
        "torch.zeros_like(frames[-1:]).expand(pad, -1, -1, -1)",
        (VIDEO + "test_patches_are_the_mergers_order_and_an_odd_last_frame_is_repeated",),
    ),
    "video patches out of the merger's order": Mutant(
        "encoder/vlm_video.py",
        ").permute(0, 3, 6, 4, 7, 2, 1, 5, 8)",
        ").permute(0, 3, 4, 6, 7, 2, 1, 5, 8)",
        (VIDEO + "test_patches_are_the_mergers_order_and_an_odd_last_frame_is_repeated",),
    ),
    "a LLaVA-OneVision video's newline row not counted": Mutant(
        "encoder/vlm_video.py",
        "    trailing_rows = 1\n",
        "    trailing_rows = 0\n",
        (SQUARE + "test_rows_are_the_models_own_get_video_features[onevision-8x4x80x48]",),
    ),
    "LLaVA-OneVision's pooled side rounded down": Mutant(
        "encoder/vlm_video.py",
        "math.ceil(patches / 2) ** 2",
        "(patches // 2) ** 2",
        (
            SQUARE
            + "test_rows_are_the_models_own_get_video_features[onevision+odd+config-8x4x80x48]",
        ),
    ),
    "InternVL video rows token by token, not frame after frame": Mutant(
        "encoder/vlm_video.py",
        "rows.append(out.pooler_output.reshape(-1, out.pooler_output.shape[-1]))",
        "rows.append(out.pooler_output.transpose(0, 1).reshape(-1, out.pooler_output.shape[-1]))",
        (SQUARE + "test_rows_are_the_models_own_get_video_features[internvl-8x4x80x48]",),
    ),
    "InternVL frame rows not the tile's": Mutant(
        "encoder/vlm_video.py",
        "else cls(settings, per_tile(vlm.config))",
        "else cls(settings, per_tile(vlm.config) + 1)",
        (SQUARE + "test_rows_are_the_models_own_get_video_features[internvl-8x4x80x48]",),
    ),
    "square video frames' resample ignored": Mutant(
        "encoder/vlm_video.py",
        "size = (settings.height, settings.width)\n        frames = processor_resize("
        "frames.unsqueeze(0), size, settings.resample)[0]",
        "size = (settings.height, settings.width)\n        frames = processor_resize("
        "frames.unsqueeze(0), size, 3)[0]",
        (SQUARE + "test_pixels_are_the_processors_recorded_ones[onevision+bilinear]",),
    ),
    "a square video processor's saved mean and std ignored": Mutant(
        "encoder/vlm_video.py",
        'for key in ("image_mean", "image_std"):',
        "for key in ():",
        (SQUARE + "test_pixels_are_the_processors_recorded_ones[onevision+odd+config]",),
    ),
    "a video processor's centre crop ignored": Mutant(
        "encoder/vlm_video.py",
        'if saved.get("do_center_crop"):',
        "if False:",
        (SQUARE + "test_a_video_processor_not_reproduced_gives_no_video[crop]",),
    ),
    "a square video frame not checked against the tower": Mutant(
        "encoder/vlm_video.py",
        "if not settings.do_resize or (settings.height, settings.width) != (side, side):",
        "if not settings.do_resize:",
        (SQUARE + "test_a_video_processor_not_reproduced_gives_no_video[size]",),
    ),
    "a family takes another video path's processor": Mutant(
        "encoder/vlm_video.py",
        "return named if VIDEO_PROCESSORS[named] is VIDEO_PROCESSORS[family] else None",
        "return named",
        (
            SQUARE
            + "test_the_processor_class_is_the_one_transformers_picks[llava_onevision-saved5-None]",
        ),
    ),
    "audio: a header's seconds unchecked": Mutant(
        "encoder/audio.py",
        "    if seconds is not None and seconds > limits.max_seconds:",
        "    if False:",
        (
            "tests/test_encoder_audio.py::test_a_tiny_file_claiming_hours_is_refused_from_its_h"
            "eader",
        ),
    ),
    "audio: a header's output bytes unchecked": Mutant(
        "encoder/audio.py",
        '        _check_output(math.ceil(header.seconds * sampling_rate), "declares", limits)',
        "        pass",
        (
            "tests/test_encoder_audio.py::test_a_header_over_a_limit_is_refused_before_any_pack"
            "et_is_decoded[flac-limits2-max_output_bytes-exact2]",
        ),
    ),
    "audio: the samples held unchecked": Mutant(
        "encoder/audio.py",
        "            if held > most:",
        "            if False:",
        (
            "tests/test_encoder_audio.py::test_more_samples_than_declared_are_stopped_with_boun"
            "ded_memory[says-1s]",
        ),
    ),
    "audio: the resampler's slack loose": Mutant(
        "encoder/audio.py",
        "_RESAMPLER_SLACK = 1\n",
        "_RESAMPLER_SLACK = 4096\n",
        (
            "tests/test_encoder_audio.py::test_a_clip_a_little_over_without_a_declared_length_i"
            "s_stopped_while_decoding",
        ),
    ),
    "audio: the CPU budget unchecked": Mutant(
        "encoder/audio.py",
        "            _check_budget(started, limits)\n",
        "",
        ("tests/test_encoder_audio.py::test_a_decode_past_its_budget_is_stopped",),
    ),
    "audio: any codec opened": Mutant(
        "encoder/audio.py",
        "    if codec not in CODECS:",
        "    if False:",
        ("tests/test_encoder_audio.py::test_a_codec_outside_the_list_is_refused_before_decoding",),
    ),
    "audio: channels not limited": Mutant(
        "encoder/audio.py",
        "    if channels > limits.max_channels:",
        "    if False:",
        (
            "tests/test_encoder_audio.py::test_a_header_over_a_limit_is_refused_before_any_pack"
            "et_is_decoded[wav-limits1-max_channels-exact1]",
        ),
    ),
    "audio: channels not mixed to one": Mutant(
        "encoder/audio.py",
        'av.AudioResampler(format="fltp", layout="mono", rate=sampling_rate)',
        'av.AudioResampler(format="fltp", rate=sampling_rate)',
        ("tests/test_encoder_audio.py::test_channels_are_mixed_to_one",),
    ),
    "audio: a damaged packet fails the clip": Mutant(
        "encoder/audio.py",
        "                skipped = skipped or exc\n                continue",
        "                raise",
        ("tests/test_encoder_audio.py::test_a_truncated_flac_gives_the_samples_it_has",),
    ),
    "Qwen2-Audio's feature mask dropped": Mutant(
        "encoder/vlm_audio.py",
        "    hidden = tower(features, attention_mask=attention).last_hidden_state",
        "    hidden = tower(features).last_hidden_state",
        ("tests/test_encoder_vlm_audio.py::test_rows_are_what_the_models_own_forward_merges[1.0]",),
    ),
    "Qwen2-Audio's window not refused": Mutant(
        "encoder/vlm_audio.py",
        '        if self.extractor_kwargs.get("truncation") is False and len(decoded.samples) >'
        " window:",
        "        if False:",
        ("tests/test_encoder_vlm_audio.py::test_a_clip_longer_than_the_window_is_refused",),
    ),
    "an audio clip's token count off": Mutant(
        "encoder/vlm_audio.py",
        "    return (after_conv - 2) // 2 + 1",
        "    return (after_conv - 1) // 2 + 1",
        ("tests/test_encoder_vlm_audio.py::test_lengths_are_sglangs[7.37-737-184]",),
    ),
    "the thinker's processor config ignored": Mutant(
        "encoder/vlm_audio.py",
        '    processor = _read(thinker, "processor_config") or _read(config, "processor_config")',
        '    processor = _read(config, "processor_config")',
        (
            "tests/test_encoder_vlm_audio.py::test_the_sampling_rate_is_resolved_as_sglang_reso"
            "lves_it[config4-48000]",
        ),
    ),
    "Omni's audio padding unmasked": Mutant(
        "encoder/vlm_audio.py",
        "feature_attention_mask=mask.to(device)",
        "feature_attention_mask=torch.ones_like(mask).to(device)",
        ("tests/test_encoder_vlm_audio.py::test_omni_padding_frames_are_masked",),
    ),
    "Omni's part prefix kept": Mutant(
        "encoder/vlm.py",
        '        stored = stored.removeprefix(f"{part}.")\n',
        "",
        ("tests/test_encoder_vlm_audio.py::test_omni_loads_only_the_thinkers_towers",),
    ),
    "images sent to an audio model": Mutant(
        "encoder/vlm.py",
        "        if not self.family.images:\n            raise",
        "        if False:\n            raise",
        ("tests/test_encoder_vlm_audio.py::test_an_audio_model_takes_no_images",),
    ),
    "videos decoded in the image threads": Mutant(
        "encoder/batcher.py",
        '        run = self.in_worker_thread if modality == "IMAGE" else self.in_media_thread',
        "        run = self.in_worker_thread",
        (
            "tests/test_encoder_video_limits.py::test_an_image_is_served_while_videos_hold_ever"
            "y_video_thread[1]",
        ),
    ),
    "the media threads unbounded": Mutant(
        "encoder/batcher.py",
        "worker_threads(settings.media_decode_threads)",
        "worker_threads(8)",
        (
            "tests/test_encoder_video_limits.py::test_an_image_is_served_while_videos_hold_ever"
            "y_video_thread[1]",
        ),
    ),
    "a video decoded without the settings' limits": Mutant(
        "encoder/batcher.py",
        "decoded = decode_video(data, self.video.sampling, self.video_limits)",
        "decoded = decode_video(data, self.video.sampling)",
        (
            "tests/test_encoder_video_limits.py::test_each_video_limit_setting_refuses_a_clip_o"
            "ver_it_as_a_413[video_decode_cpu_seconds-1e-09]",
        ),
    ),
    "a video over a limit answered 400": Mutant(
        "encoder/batcher.py",
        "            return self.model.decode(data, max_pixels=self.settings.max_image_pixels)"
        "\n        except InvalidInput as exc:  # its own class: a video over a limit stays a 4"
        "13\n            raise type(exc)(",
        "            return self.model.decode(data, max_pixels=self.settings.max_image_pixels)"
        "\n        except InvalidInput as exc:  # its own class: a video over a limit stays a 4"
        "13\n            raise InvalidInput(",
        (
            "tests/test_encoder_video_limits.py::test_each_video_limit_setting_refuses_a_clip_o"
            "ver_it_as_a_413[video_max_output_bytes-46079]",
        ),
    ),
    "video headers checked only in the video thread": Mutant(
        "encoder/batcher.py",
        '            if modality != "IMAGE":  # what the headers refuse',
        "            if False:  # what the headers refuse",
        (
            "tests/test_encoder_video_limits.py::test_a_video_its_header_refuses_is_answered_wh"
            "ile_the_video_thread_is_held",
        ),
    ),
    "a video header checked without the settings' limits": Mutant(
        "encoder/batcher.py",
        "            check_header(data, self.video_limits)",
        "            check_header(data)",
        (
            "tests/test_encoder_video_limits.py::test_a_video_its_header_refuses_is_answered_wh"
            "ile_the_video_thread_is_held",
        ),
    ),
    "video_max_pixels read from another setting": Mutant(
        "encoder/video.py",
        "max_pixels=settings.video_max_pixels,",
        "max_pixels=settings.video_max_frame_pixels,",
        ("tests/test_encoder_video_limits.py::test_the_limits_are_the_settings",),
    ),
    "an MP4's sample tables unchecked": Mutant(
        "encoder/video.py",
        '    if container_format == "mov":\n        _check_sample_tables(data, limits)',
        "    if False:\n        _check_sample_tables(data, limits)",
        (
            "tests/test_encoder_video.py::test_a_sample_table_declaring_millions_is_refused_bef"
            "ore_ffmpeg_opens_it[mp4-soun]",
        ),
    ),
    "an MP4's fragments not summed": Mutant(
        "encoder/video.py",
        "in_fragments[track] = in_fragments.get(track, 0) + count",
        "in_fragments[track] = count",
        (
            "tests/test_encoder_video.py::test_a_fragment_declaring_millions_is_refused_before_"
            "ffmpeg_opens_it",
        ),
    ),
    "PCM audio counted by its samples": Mutant(
        "encoder/video.py",
        '    return handler, 0 if handler == "soun" and by_chunk else samples',
        "    return handler, samples",
        ("tests/test_encoder_video.py::test_pcm_audio_is_not_counted_by_its_samples",),
    ),
    "the boxes walked unbounded": Mutant(
        "encoder/video.py",
        "            self.left -= 1",
        "            self.left -= 0",
        (
            "tests/test_encoder_video.py::test_the_boxes_walked_before_ffmpeg_opens_a_file_are_"
            "bounded",
        ),
    ),
    "a track's chunk indexing misjudged": Mutant(
        "encoder/video.py",
        "                by_chunk = (by_chunk is not False) and runs == 1 and delta == 1",
        "                by_chunk = runs == 1 and delta == 1",
        (
            "tests/test_encoder_video.py::test_a_track_is_counted_by_its_samples_unless_ffmpeg_"
            "indexes_it_by_chunk[handlers6-deltas6-True]",
        ),
    ),
    "a track's handler searched in the wrong order": Mutant(
        "encoder/video.py",
        '    for named in (b"vide", b"soun", *handlers[:1]):',
        '    for named in (*handlers[:1], b"vide", b"soun"):',
        (
            "tests/test_encoder_video.py::test_a_track_is_counted_by_its_samples_unless_ffmpeg_"
            "indexes_it_by_chunk[handlers3-deltas3-True]",
        ),
    ),
    "audio decoded in the image threads": Mutant(
        "encoder/batcher.py",
        '        run = self.in_worker_thread if modality == "IMAGE" else self.in_media_thread',
        '        run = self.in_worker_thread if modality != "VIDEO" else self.in_media_thread',
        (
            "tests/test_encoder_audio_parts.py::test_an_image_is_served_while_clips_hold_every_"
            "media_thread[1]",
        ),
    ),
    "AUDIO not among the modalities": Mutant(
        "encoder/front.py",
        '"VIDEO": video, "AUDIO": audio}',
        '"VIDEO": video}',
        (
            "tests/test_encoder_audio_parts.py::test_a_part_of_clips_is_the_models_audio_path_t"
            "o_the_bit[qwen2_audio]",
        ),
    ),
    "an audio model takes images": Mutant(
        "encoder/front.py",
        'paths = {"IMAGE": takes_images(backend),',
        'paths = {"IMAGE": True,',
        (
            "tests/test_encoder_audio_parts.py::test_an_audio_model_refuses_an_image_part_befor"
            "e_loading_it",
        ),
    ),
    "audio loaded as images": Mutant(
        "encoder/front.py",
        '        if modality != "IMAGE":\n            return await self._load_media(',
        '        if modality == "VIDEO":\n            return await self._load_media(',
        (
            "tests/test_encoder_audio_parts.py::test_a_part_of_clips_is_the_models_audio_path_t"
            "o_the_bit[qwen2_audio]",
        ),
    ),
    "the audio recipe left out of a clip's key": Mutant(
        "encoder/front.py",
        '    if modality == "AUDIO" and audio is not None:',
        "    if False:",
        ("tests/test_encoder_audio_parts.py::test_an_audio_clips_key_names_its_recipe",),
    ),
    "an audio-only model warmed up on an image": Mutant(
        "encoder/batcher.py",
        "        if not self.images and self.audio is not None:",
        "        if False:",
        (
            "tests/test_encoder_audio_parts.py::test_an_audio_only_model_warms_up_on_a_clip_of_"
            "silence",
        ),
    ),
    "an audio clip decoded without the settings' limits": Mutant(
        "encoder/batcher.py",
        "clip = decode_audio(data, self.audio.sampling_rate, self.audio_limits)",
        "clip = decode_audio(data, self.audio.sampling_rate)",
        (
            "tests/test_encoder_audio_parts.py::"
            "test_a_clip_whose_header_understates_it_is_stopped_at_the_settings_limit",
        ),
    ),
    "the settings' audio limits not read": Mutant(
        "encoder/batcher.py",
        "self.audio_limits = AudioLimits.from_settings(settings)",
        "self.audio_limits = AudioLimits()",
        (
            "tests/test_encoder_audio_parts.py::"
            "test_a_clip_over_the_decode_limits_is_a_413_naming_its_item[qwen2_audio]",
        ),
    ),
    "audio clips forwarded by the image path": Mutant(
        "encoder/batcher.py",
        "        if isinstance(item, PreparedAudio):\n            assert self.audio is not None",
        "        if False:\n            assert self.audio is not None",
        (
            "tests/test_encoder_audio_parts.py::test_a_part_of_clips_is_the_models_audio_path_t"
            "o_the_bit[qwen2_5_omni]",
        ),
    ),
    "no audio path looked up": Mutant(
        "encoder/front.py",
        "audio=audio if audio is not None else audio_path_for(backend, self.settings),",
        "audio=audio,",
        (
            "tests/test_encoder_audio_parts.py::test_a_part_of_clips_is_the_models_audio_path_t"
            "o_the_bit[qwen2_audio]",
        ),
    ),
    "Omni serves no images": Mutant(
        "encoder/front.py",
        "    return not isinstance(model, VLMVisionModel) or model.family.images",
        "    return not isinstance(model, VLMVisionModel)",
        (
            "tests/test_encoder_audio_parts.py::test_a_part_of_clips_is_the_models_audio_path_t"
            "o_the_bit[qwen2_5_omni]",
        ),
    ),
    "an audio part's grid sent as a list": Mutant(
        "completion/message.py",
        '        if grid is not None and self.modality == "AUDIO":',
        "        if False:",
        (
            "tests/test_encoder_audio_parts.py::test_an_audio_parts_rank_is_told_its_modality_a"
            "nd_clip_lengths[qwen2_audio]",
        ),
    ),
    "Omni clips of a forward in one call": Mutant(
        "encoder/vlm_audio.py",
        "    rows = []\n    for clip in clips:",
        "    rows = []\n    for clip in clips[:0]:",
        (
            "tests/test_encoder_vlm_audio.py::test_omni_rows_are_the_thinkers_own_get_audio_fea"
            "tures",
        ),
    ),
    "a long video's frames past the first resize chunk left blank": Mutant(
        "encoder/vlm_video.py",
        "    for start in range(0, frames.shape[0], RESIZE_FRAMES):",
        "    for start in range(0, min(frames.shape[0], RESIZE_FRAMES), RESIZE_FRAMES):",
        (VIDEO + "test_sglangs_resize_of_a_long_video_is_each_frames_own",),
    ),
    "audio headers read only in the media thread": Mutant(
        "encoder/batcher.py",
        '            if modality != "IMAGE":  # what the headers refuse',
        '            if modality == "VIDEO":  # what the headers refuse',
        (
            "tests/hostile/test_audio.py::test_hostile_audio_is_refused_naming_its_item_and_lim"
            "it_and_images_are_served_beside",
        ),
    ),
    "Qwen2.5-Omni's seconds per grid not sent": Mutant(
        "encoder/vlm_video.py",
        '_SECONDS_PER_GRID = frozenset({"qwen2_5_vl", "qwen2_5_omni"})',
        '_SECONDS_PER_GRID = frozenset({"qwen2_5_vl"})',
        (
            "tests/test_encoder_vlm_video_omni.py::test_the_metadata_is_second_per_grid_ts_as_s"
            "glangs_encoder_reports_it[tiny]",
        ),
    ),
    "Qwen2.5-Omni without a video path": Mutant(
        "encoder/vlm_video.py",
        '    "qwen2_5_omni": "Qwen2VLVideoProcessor",\n',
        "",
        (
            "tests/test_encoder_vlm_video_omni.py::test_the_encoder_serves_omni_videos_beside_i"
            "mages_and_audio",
        ),
    ),
    "an Omni video path looked up by the thinker's model_type": Mutant(
        "encoder/vlm_video.py",
        "        model_type = vlm.model_type\n        if model_type not in FAMILY_PROCESSORS:",
        "        model_type = str(vlm.config.model_type)\n        if model_type not in FAMILY_P"
        "ROCESSORS:",
        (
            "tests/test_encoder_vlm_video_omni.py::test_the_encoder_serves_omni_videos_beside_i"
            "mages_and_audio",
        ),
    ),
    "an Omni video's metadata chosen by the thinker's model_type": Mutant(
        "encoder/vlm_video.py",
        "return cls(vlm.model_type, settings, sampling, pixels, merge)",
        "return cls(str(vlm.config.model_type), settings, sampling, pixels, merge)",
        (
            "tests/test_encoder_vlm_video_omni.py::test_the_metadata_is_second_per_grid_ts_as_s"
            "glangs_encoder_reports_it[tiny]",
        ),
    ),
    "the access log without an /encode's modality": Mutant(
        "server/app.py",
        '                fields["modality"] = modality',
        "                pass",
        ("tests/test_http_probes.py::test_one_access_log_line_per_answer[True]",),
    ),
    "a video's deepstack columns dropped": Mutant(
        "encoder/vlm_video.py",
        "        if vlm.family.deepstack:",
        "        if False:",
        (VIDEO + "test_rows_are_the_models_own_get_video_features[qwen3_vl-8x4x80x48]",),
    ),
    "Qwen2.5-VL's seconds per grid not sent": Mutant(
        "encoder/vlm_video.py",
        '_SECONDS_PER_GRID = frozenset({"qwen2_5_vl", "qwen2_5_omni"})',
        '_SECONDS_PER_GRID = frozenset({"qwen2_5_omni"})',
        (VIDEO + "test_metadata_is_sglangs[qwen2_5_vl]",),
    ),
    "a video kept without its metadata: a hit answers without it": Mutant(
        "encoder/batcher.py",
        "            kept = Kept(row, job.image.grid, checksum, segment, job.image.meta)",
        "            kept = Kept(row, job.image.grid, checksum, segment)",
        (
            KEEP + "test_the_same_bytes_as_an_image_and_as_a_video_never_share_an_entry[cache]",
            KEEP + "test_a_repeated_video_of_a_real_model_is_a_hit_with_the_same_answer[arena]",
            PARTS + "test_a_part_of_videos_is_the_models_video_path_to_the_bit",
        ),
    ),
    "videos not kept: every repeat runs the forward again": Mutant(
        "encoder/batcher.py",
        "            self.keeper.keep(job.key, kept)  # with its metadata",
        "            isinstance(job.image, PreparedVideo) or self.keeper.keep(job.key, kept)  #",
        (
            KEEP + "test_the_same_bytes_as_an_image_and_as_a_video_never_share_an_entry[arena]",
            KEEP + "test_a_repeated_video_of_a_real_model_is_a_hit_with_the_same_answer[cache]",
        ),
    ),
    "an item's key without its modality: an image's row served for a video": Mutant(
        "encoder/cache.py",
        "    return CacheKey(model_id, hashlib.sha256(data).hexdigest(), modality, recipe)",
        "    return CacheKey(model_id, hashlib.sha256(data).hexdigest(), recipe=recipe)",
        (KEEP + "test_an_items_key_names_its_modality_and_its_recipe",),
    ),
    "a video's key without its frame sampling: another sampling's rows served": Mutant(
        "encoder/front.py",
        "        return recipe_digest(video.recipe)",
        '        return "video"',
        (KEEP + "test_different_frame_samplings_never_share_an_entry",),
    ),
    "the store's key without an item's modality and recipe": Mutant(
        "encoder/store.py",
        "{key.modality}/{key.recipe or '-'}/{key.sha256}",
        "{key.sha256}",
        (
            KEEP + "test_the_same_bytes_as_an_image_and_as_a_video_never_share_an_entry[store]",
            KEEP + "test_different_frame_samplings_never_share_an_entry",
        ),
    ),
    "a cached row's metadata dropped by plain memory": Mutant(
        "encoder/keeping.py",
        "self.cache.digest(key), meta=self.cache.meta(key))",
        "self.cache.digest(key))",
        (KEEP + "test_the_same_bytes_as_an_image_and_as_a_video_never_share_an_entry[cache]",),
    ),
    "a store hit copied into the arena without its metadata": Mutant(
        "encoder/keeping.py",
        "        copied = Kept(row, stored.grid, stored.checksum, segment, stored.meta)",
        "        copied = Kept(row, stored.grid, stored.checksum, segment)",
        (KEEP + "test_a_repeated_video_is_served_from_the_store_with_its_metadata",),
    ),
    "a store entry's metadata not stored or not read": Mutant(
        "encoder/keeping.py",
        "            grid=kept.grid,\n            meta=kept.meta,\n",
        "            grid=kept.grid,\n",
        (
            KEEP + "test_the_same_bytes_as_an_image_and_as_a_video_never_share_an_entry[store]",
            KEEP + "test_a_repeated_video_is_served_from_the_store_with_its_metadata",
        ),
    ),
    "a store entry whose description was changed served (failure 24)": Mutant(
        "encoder/store.py",
        "    if not hmac.compare_digest(_tag(seal, name, front, body), header[:_DIGEST]):",
        "    if False:",
        (
            KEEP + "test_a_store_entry_whose_metadata_was_changed_is_never_served[unkeyed]",
            KEEP + "test_a_store_entry_whose_metadata_was_changed_is_never_served[keyed]",
        ),
    ),
    "a description tagged without the fleet's secret served under it": Mutant(
        "encoder/store.py",
        "    return xxhash.xxh3_64_digest(text) if seal is None else seal.tag(text)",
        "    return xxhash.xxh3_64_digest(text)",
        (KEEP + "test_a_forged_description_is_refused_under_a_fleet_secret",),
    ),
    "a description longer than its room stored cut": Mutant(
        "encoder/store.py",
        "    if len(text) > _HEADER - _DIGEST - _LENGTH:",
        "    if False:",
        (KEEP + "test_a_row_whose_description_does_not_fit_is_not_stored",),
    ),
    "a video part routed by its items alone": Mutant(
        "client/ranking.py",
        '    if modality != "IMAGE":\n        # Personalised',
        "    if False:\n        # Personalised",
        (KEEP + "test_a_video_part_routes_on_its_own_key",),
    ),
    "a video part's rank told it is an image": Mutant(
        "service/messages.py",
        "                modality=shape.media.modality,\n",
        "",
        (PARTS + "test_a_video_parts_rank_is_told_its_modality_grid_and_metadata",),
    ),
    "a video part's metadata not gathered": Mutant(
        "encoder/keeping.py",
        "    return tuple(meta)",
        "    return ()",
        (PARTS + "test_a_part_of_videos_is_the_models_video_path_to_the_bit",),
    ),
    "every caller of the video bench row sends the same video": Mutant(
        "tools/bench/videos.py",
        "    return [bench_video(seed) for seed in range(count)]",
        "    return [bench_video(0) for seed in range(count)]",
        ("tests/test_bench_model.py::test_each_caller_of_the_video_row_has_its_own_video",),
    ),
    "the video bench row's frames per second not per second": Mutant(
        "tools/bench/results.py",
        "        return per_video * self.served_videos / self.served_seconds",
        "        return per_video",
        ("tests/test_bench_model.py::test_the_video_rows_rates_ratio_and_decoding_share",),
    ),
    "a tool's help section comes after the product's": Mutant(
        "declare.py",
        "    return own + [name for name in GROUPS if name in unique]",
        "    return [name for name in GROUPS if name in unique] + own",
        ("tests/test_cli.py::test_a_tool_s_own_help_section_comes_before_the_product_s",),
    ),
    "a fast route logs and counts nothing (hot path)": Mutant(
        "server/app.py",
        "        self.record(",
        "        (lambda *a: None)(",
        (
            "tests/test_server_fast_routes.py::test_the_fast_routes_answer_log_and_count_exactl"
            "y_as_quart_does",
        ),
    ),
    "the log writer wakes per line (hot path)": Mutant(
        "logs.py",
        "            _linger()\n"
        "            with self._wake:\n                lines = list(self._pending)",
        "            with self._wake:\n                lines = list(self._pending)",
        (
            "tests/test_log_sink.py::test_a_woken_writer_lingers_so_lines_arriving_meanwhile_go"
            "_in_one_write_and_one_wake",
        ),
    ),
    "a video's duration unbounded (video)": Mutant(
        "encoder/video.py",
        "if seconds is not None and seconds > limits.max_seconds:",
        "if seconds is not None and seconds > limits.max_seconds * 1000:",
        (
            "tests/test_encoder_video.py::test_a_tiny_file_claiming_hours_is_refused_from_its_h"
            "eader",
        ),
    ),
    "a video's frames x pixels unchecked after the header (video)": Mutant(
        "encoder/video.py",
        "if len(pts) > limits.max_frames or len(pts) * pixels > limits.max_pixels:",
        "if False:",
        (
            "tests/test_encoder_video.py::test_a_header_understating_the_stream_is_caught_by_th"
            "e_packet_walk",
        ),
    ),
    "a frame larger than declared decoded (video)": Mutant(
        "encoder/video.py",
        "if (frame.width, frame.height) != (width, height):",
        "if False:",
        (
            "tests/test_encoder_video.py::test_a_frame_larger_than_declared_is_stopped_while_de"
            "coding",
        ),
    ),
    "a video decode without its CPU budget (video)": Mutant(
        "encoder/video.py",
        "    if _cpu_clock() - started > limits.budget_s:",
        "    if False:",
        ("tests/test_encoder_video.py::test_a_decode_past_its_budget_is_stopped",),
    ),
    "frames past the packet count decoded (video)": Mutant(
        "encoder/video.py",
        "if self.fresh > self.packets or self.decoded > 2 * self.packets:",
        "if self.decoded > 2 * self.packets:",
        ("tests/test_encoder_video.py::test_frames_past_the_packet_count_are_stopped",),
    ),
    "frames chosen off SGLang's rule (video)": Mutant(
        "encoder/video.py",
        "count = math.floor(count / FRAME_FACTOR) * FRAME_FACTOR",
        "count = math.ceil(count / FRAME_FACTOR) * FRAME_FACTOR",
        ("tests/test_encoder_video.py::test_frame_indices_follow_sglangs_rule",),
    ),
    "the keep-alive timer never closes an idle connection (connections)": Mutant(
        "server/connections.py",
        "        with trio.CancelScope(shield=True):\n"
        "            await self._connection._initiate_server_close()",
        "        with trio.CancelScope(shield=True):\n            pass",
        (
            "tests/test_server_keep_alive.py::test_an_idle_connection_closes_after_the_timeout_"
            "and_a_long_call_is_never_cut",
        ),
    ),
    "the keep-alive timer cuts a long call (connections)": Mutant(
        "server/connections.py",
        "        self._idle = False\n        self._scope.deadline = math.inf",
        "        self._idle = False",
        (
            "tests/test_server_keep_alive.py::test_an_idle_connection_closes_after_the_timeout_"
            "and_a_long_call_is_never_cut",
        ),
    ),
    "the keep-alive timer outlives its connection's reading (connections)": Mutant(
        "server/connections.py",
        "            self.idle_task.end()  # type: ignore[attr-defined]",
        "            pass",
        ("tests/hostile/test_connections.py::test_a_round_of_every_connection_abuse",),
    ),
    "the model interface imports a model again (layers)": Mutant(
        "encoder/backend.py",
        "from trio_encode.encoder.images import Preprocess, decode_image\n",
        "from trio_encode.encoder.images import Preprocess, decode_image\n\n\n"
        "def _circle() -> None:\n"
        "    from trio_encode.encoder.hf import load_hf_model  # noqa: F401\n",
        ("tests/test_layers.py::test_no_modules_import_each_other_around_a_circle",),
    ),
    "the product serve takes a drill's options again (layers)": Mutant(
        "cli.py",
        "@server_options(*SERVE_GROUPS)\ndef serve(",
        "@server_options(*SERVE_GROUPS)\n@model_options(_drill_settings)\ndef serve(",
        (
            "tests/test_layers.py::"
            "test_the_serve_command_imports_nothing_from_the_tools_or_the_test_doubles",
        ),
    ),
}


def _mutated_tree(tmp: str, name: str, mutant: Mutant) -> Path:
    src = Path(tmp) / "src"
    shutil.copytree(ROOT / "src", src)
    for file, old, new in mutant.edits():
        target = src / "trio_encode" / file
        text = target.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"mutant {name!r} no longer applies to {file}; update it")
        target.write_text(text.replace(old, new))
    return src


def _pytest(src: Path, tests: tuple[str, ...], *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT / 'tests'}"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *tests]
    try:
        return subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired as exc:
        # A hang is a failure too, if a poor one.
        return subprocess.CompletedProcess(command, 1, "", f"timed out: {exc}")


def run_mutant(name: str, mutant: Mutant) -> bool:
    """True if the mutant's killers fail (the mutant is killed)."""
    if not mutant.killers:
        raise SystemExit(f"mutant {name!r} names no killers")
    with tempfile.TemporaryDirectory() as tmp:
        result = _pytest(_mutated_tree(tmp, name, mutant), mutant.killers, "-x")
        # Only failing tests kill: an error finding a killer (exit code 4 or 5) is no kill.
        return result.returncode == 1


def killers_of(name: str, mutant: Mutant) -> list[str]:
    """Every test in the broad lifecycle suite that fails with the mutant in place."""
    with tempfile.TemporaryDirectory() as tmp:
        result = _pytest(_mutated_tree(tmp, name, mutant), BROAD, "-rf", "--tb=no")
        return re.findall(r"^FAILED (\S+)", result.stdout, flags=re.MULTILINE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broad", action="store_true", help="list every test that kills each")
    parser.add_argument("-k", dest="only", default="", help="only mutants whose name has this")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    args = parser.parse_args()
    chosen = {name: m for name, m in MUTANTS.items() if args.only in name}
    if args.broad:
        for name, mutant in chosen.items():
            killers = killers_of(name, mutant)
            print(f"{name}: {len(killers)} killer(s)")
            for killer in killers:
                print(f"    {killer}")
        return 0
    survivors = []
    # Each mutant runs in its own copy of the package, so two run at once (CI has 2 cores; the
    # killers' subprocesses mostly wait on sockets and sleeps).
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = {pool.submit(run_mutant, name, mutant): name for name, mutant in chosen.items()}
        for run in as_completed(runs):
            name = runs[run]
            killed = run.result()
            print(f"{'killed  ' if killed else 'SURVIVED'}  {name}", flush=True)
            if not killed:
                survivors.append(name)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
