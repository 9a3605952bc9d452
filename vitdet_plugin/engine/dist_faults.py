"""A clear report when a rank of a distributed run dies.

When a rank dies, the others are blocked in a collective. Under torchrun the agent notices the
dead process within a second and stops the rest (its summary names the failed rank). Started
without a supervisor (a multi-node job, a SLURM / hand-written launcher), gloo raises on the
survivors as soon as the dead process's sockets close ("Connection closed by peer"); a rank
that is alive but hung is only noticed at the collective timeout. :func:`train_with_fault_report`
(around ``runner.train()``) turns that raw error into one message naming the rank that failed,
with its exception and iteration, or the rank that vanished without a report (SIGKILL, OOM
killer), or the rank that hung, and the checkpoint to resume from. It keeps per-rank keys in
the job's rendezvous store (``MASTER_ADDR:MASTER_PORT``): a heartbeat a background thread sets
every :data:`HEARTBEAT_INTERVAL_S` (a process whose heartbeat stops was killed, one whose
heartbeat goes on is alive but stuck) and a record written on the way out (``failed`` with the
exception, ``peer`` when the rank stopped on the communication error, ``done``).
"""
import faulthandler
import gc
import json
import logging
import math
import os
import os.path as osp
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, NamedTuple, Optional, TypeVar

import torch.distributed as torch_dist
from mmengine.hooks import Hook
from mmengine.logging import MMLogger



#: timeout of every store operation of the fault report (connect, get): reporting never hangs
STORE_TIMEOUT_S = 2.0
#: period of the heartbeat thread's ``store.set`` (fire-and-forget, a few microseconds each)
HEARTBEAT_INTERVAL_S = 1.0
#: a heartbeat unchanged for this long: the process is gone (3 missed beats)
STALE_AFTER_S = 3.0 * HEARTBEAT_INTERVAL_S
#: the longest a survivor waits for the other ranks' records before it reports
REPORT_WAIT_S = 6.0
#: a rank whose heartbeat thread sees another rank's failure but whose own training never gets
#: the communication error (it is stuck outside any collective) exits after this long
HANG_GRACE_S = 60.0
#: SIGALRM ends the process this long after a fault if its teardown has not finished
EXIT_DEADLINE_S = 60.0
POLL_S = 0.1
MAX_ERROR_CHARS = 300
#: exit status of a rank stopped by the hang watchdog
WATCHDOG_EXIT_CODE = 1
STORE_PREFIX = 'vitdet_fault'
ABORT_REASONS = dict(failed='failed', peer='stopped on a communication error', hung='hung')
#: text of gloo / NCCL / c10d errors raised when a peer is gone or a collective timed out
COMM_ERROR_MARKERS = ('gloo/transport', 'Connection closed by peer', 'Connection reset by peer',
                      'Timed out waiting', 'Broken pipe', 'NCCL', 'collective operation timeout',
                      'ProcessGroup')

T = TypeVar('T')
logger = logging.getLogger(__name__)



class DistributedFaultError(RuntimeError):
    """Raised on a surviving rank when a collective failed; the message names the ranks."""

    def __init__(self, message: str, failed: List[int], gone: List[int],
                 hung: List[int]) -> None:
        super().__init__(message)
        self.failed, self.gone, self.hung = failed, gone, hung


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective / store failure (a peer gone, a timeout)."""
    if isinstance(exc, getattr(torch_dist, 'DistError', ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in COMM_ERROR_MARKERS)


def _short(exc: BaseException) -> str:
    text = ' '.join(str(exc).split())
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + '...'
    return f'{type(exc).__name__}: {text}' if text else type(exc).__name__


def _at(iteration: Optional[int]) -> str:
    return f' at iteration {iteration}' if iteration is not None else ''


class Survey(NamedTuple):
    """What a rank learns about the others after a failure."""
    records: Dict[int, dict]  # rank -> its exit record (kind, iteration, error)
    gone: List[int]  # no record, heartbeat stopped: killed
    silent: List[int]  # no record, heartbeat going on: hung, or blocked in a collective
    last: Dict[int, Optional[int]]  # rank -> iteration of its last heartbeat


class FaultReporter:
    """This rank's heartbeat and exit record in the rendezvous store, and the survey of the
    other ranks after a failure. Keys ``vitdet_fault/<run>/{hb,rec,ack}/<rank>`` and ``abort``.

    The heartbeat thread also watches ``abort`` (set with every failure record): it copies the
    records it can see (readable after rank 0, the store's host, is gone), acknowledges with
    ``ack/<rank>`` and, if this rank's training never gets the communication error (stuck
    outside a collective), ends the process after ``hang_grace_s`` with its stacks.
    """

    def __init__(self, rank: int, world_size: int, host: str, port: int,
                 hang_grace_s: float = HANG_GRACE_S) -> None:
        self.rank, self.world_size, self.host, self.port = rank, world_size, host, port
        self.hang_grace_s = hang_grace_s
        run = os.environ.get('TORCHELASTIC_RUN_ID', 'job')
        self.prefix = f"{STORE_PREFIX}/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        #: under torchrun the agent hosts the store; otherwise rank 0's process does
        self.agent_store = os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == str(True)
        self.others = [q for q in range(world_size) if q != rank]
        self.iteration: Optional[int] = None  # 1-based, set by FaultProgressHook
        self.handling = False  # the main thread is in the fault path
        self.seen: Dict[int, dict] = {}  # records the heartbeat thread copied after an abort
        self._stop = threading.Event()
        self._store: Any = None
        self._thread: Optional[threading.Thread] = None

    @property
    def hosts_store(self) -> bool:
        return self.rank == 0 and not self.agent_store

    def _connect(self) -> Any:
        return torch_dist.TCPStore(self.host, self.port, is_master=False,
                                   timeout=timedelta(seconds=STORE_TIMEOUT_S),
                                   wait_for_workers=False)

    def _key(self, kind: str, rank: int) -> str:
        return f'{self.prefix}/{kind}/{rank}'

    def start(self) -> None:
        self._store = self._connect()
        self._thread = threading.Thread(target=self._beat, args=(self._connect(),),
                                        name='vitdet-heartbeat', daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_TIMEOUT_S + HEARTBEAT_INTERVAL_S)

    def _beat(self, store: Any) -> None:
        """Heartbeat thread: ``hb/<rank>`` every HEARTBEAT_INTERVAL_S; abort watch."""
        seq, trouble_since, reason = 0, 0.0, ''
        while not self._stop.wait(0 if seq == 0 else HEARTBEAT_INTERVAL_S):
            seq += 1
            try:
                store.set(self._key('hb', self.rank), json.dumps([seq, self.iteration]))
                if not store.check([f'{self.prefix}/abort']):
                    continue
                reason = reason or store.get(f'{self.prefix}/abort').decode()
                for q in self.others:
                    rec = _read(store, self._key('rec', q))
                    if rec is not None:
                        self.seen[q] = rec
                store.set(self._key('ack', self.rank), '1')
            except Exception:  # the store's host is gone
                reason = reason or 'the rendezvous store is unreachable'
            if self.handling:
                continue
            trouble_since = trouble_since or time.monotonic()
            if time.monotonic() - trouble_since >= self.hang_grace_s:
                self._watchdog_exit(reason)

    def _watchdog_exit(self, reason: str) -> None:
        print(f'rank {self.rank}: stopping: {reason}, and this rank{_at(self.iteration)} has '
              f'not reached a collective for {self.hang_grace_s:g} s (stuck outside '
              'communication; its stacks follow)', file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.record('hung', None)
        _flush_logs()
        os._exit(WATCHDOG_EXIT_CODE)

    def record(self, kind: str, exc: Optional[BaseException]) -> None:
        """Write this rank's exit record (``failed`` / ``peer`` / ``hung`` / ``done``); all but
        ``done`` also set the job's abort key. Never raises."""
        try:
            self._store.set(self._key('rec', self.rank), json.dumps(dict(
                kind=kind, iteration=self.iteration,
                error=_short(exc) if exc is not None else None)))
            if kind != 'done':
                self._store.set(f'{self.prefix}/abort', f'rank {self.rank} {ABORT_REASONS[kind]}')
            self._store.check([self._key('rec', self.rank)])  # a round trip: the sets landed
        except Exception as e:  # the store is gone: nothing to tell
            logger.debug('rank %d: cannot record %s: %s', self.rank, kind, e)

    def survey(self, until_acked: bool = False) -> Survey:
        """Wait (at most REPORT_WAIT_S) until every other rank has a record (or, with
        ``until_acked``, an ack) or its heartbeat stopped. Raises if the store is unreachable."""
        records: Dict[int, dict] = {}
        beats = {q: _read(self._store, self._key('hb', q)) for q in self.others}
        changed = {q: time.monotonic() for q in self.others}
        alive: set = set()
        start = now = time.monotonic()
        while True:
            for q in self.others:
                rec = None if q in records else _read(self._store, self._key('rec', q))
                if rec is not None:
                    records[q] = rec
                elif q not in records:
                    beat = _read(self._store, self._key('hb', q))
                    if beat != beats[q]:
                        beats[q], changed[q] = beat, time.monotonic()
                        alive.add(q)
            now = time.monotonic()
            pending = [q for q in self.others if q not in records
                       and now - changed[q] < STALE_AFTER_S
                       and not (until_acked and self._store.check([self._key('ack', q)]))]
            if not pending or now - start >= REPORT_WAIT_S:
                break
            time.sleep(POLL_S)
        silent = [q for q in self.others if q not in records
                  and q in alive and now - changed[q] < STALE_AFTER_S]
        gone = [q for q in self.others if q not in records and q not in silent]
        return Survey(records, gone, silent, {q: b[1] if b else None for q, b in beats.items()})


def _read(store: Any, key: str) -> Any:
    return json.loads(store.get(key)) if store.check([key]) else None


class FaultProgressHook(Hook):
    """Keeps the reporter's iteration (1-based, the ``Iter(train) [k/N]`` of the log) current:
    one attribute store per iteration, nothing sent."""
    priority = 'HIGHEST'

    def __init__(self, reporter: FaultReporter) -> None:
        self.reporter = reporter

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self.reporter.iteration = runner.iter + 1


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers + [
            h for lg in logging.Logger.manager.loggerDict.values()
            if isinstance(lg, logging.Logger) for h in lg.handlers]:
        try:
            handler.flush()
        except Exception:  # a closed handler
            pass
    sys.stdout.flush()
    sys.stderr.flush()


def _arm_exit_deadline(seconds: Optional[float]) -> None:
    """SIGALRM (default action: terminate) in ``seconds``: a teardown that hangs still ends."""
    if seconds and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(max(1, math.ceil(seconds)))


def _resume_hint(work_dir: Optional[str], config_path: str) -> str:
    ckpt = None
    if work_dir and osp.isfile(osp.join(work_dir, 'last_checkpoint')):
        with open(osp.join(work_dir, 'last_checkpoint')) as f:
            ckpt = f.read().strip() or None
    if os.environ.get('TORCHELASTIC_RUN_ID'):
        launch = (f"tools/dist_train.sh {config_path} "
                  f"{os.environ.get('LOCAL_WORLD_SIZE', os.environ.get('WORLD_SIZE', 'N'))}")
    else:
        launch = f'tools/train.py {config_path} --launcher pytorch'
    if ckpt and osp.isfile(ckpt):
        return f'the last complete checkpoint is {ckpt}; resume with {launch} --resume {ckpt}'
    return f'no checkpoint was written yet; restart with {launch}'


def _last_seen(ranks: List[int], last: Dict[int, Any]) -> str:
    def seen(q: int) -> str:
        return _at(last.get(q)).strip() or 'before its first iteration'
    if len(ranks) == 1:
        return f'last heartbeat {seen(ranks[0])}'
    return 'last heartbeats: ' + ', '.join(f'rank {q} {seen(q)}' for q in ranks)


def fault_message(reporter: FaultReporter, exc: BaseException, work_dir: Optional[str],
                  config_path: str) -> DistributedFaultError:
    """Survey the other ranks after this rank's collective failed; the error to raise."""
    parts = []
    try:
        survey = reporter.survey()
    except Exception:  # the store is gone; use what the heartbeat thread saw before
        survey = Survey(dict(reporter.seen), [], [], {})
        if reporter.agent_store:
            parts.append(f'the rendezvous store at {reporter.host}:{reporter.port} (torchrun\'s'
                         ' agent) is unreachable')
        elif 0 not in survey.records:
            survey.gone.append(0)
            parts.append(f'rank 0 (which hosts the rendezvous store at {reporter.host}:'
                         f'{reporter.port}) is gone without reporting an error (killed by a '
                         'signal, e.g. SIGKILL or the OOM killer)' + (
                             '' if survey.records else ", so no rank's report can be read"))
    records = survey.records
    for q, rec in sorted(records.items()):
        if rec.get('kind') == 'failed':
            parts.insert(0, f"rank {q} failed{_at(rec.get('iteration'))}: {rec.get('error')}")
        elif rec.get('kind') == 'hung':
            parts.append(f"rank {q} hung{_at(rec.get('iteration'))} (its watchdog ended it)")
    gone = [q for q in survey.gone if q in survey.last]  # rank 0 / the store: said above
    if gone:
        parts.append(f'rank(s) {gone} stopped without reporting an error (killed by a signal, '
                     f'e.g. SIGKILL or the OOM killer; {_last_seen(gone, survey.last)})')
    if survey.silent:
        parts.append(f'rank(s) {survey.silent} are alive but did not report (hung or stuck, '
                     'e.g. in data loading, I/O or a deadlock, or blocked in a collective; '
                     f'{_last_seen(survey.silent, survey.last)})')
    if not parts:
        peers = sorted(q for q, rec in records.items() if rec.get('kind') == 'peer')
        parts.append('no rank reported a failure of its own' + (
            f' (rank(s) {peers} stopped on the communication error too)' if peers else ''))
    msg = (f"distributed training stopped: {'; '.join(parts)}; this rank ({reporter.rank}) "
           f'stopped{_at(reporter.iteration)} on {_short(exc)}; '
           f'{_resume_hint(work_dir, config_path)}')
    failed = sorted(q for q, rec in records.items() if rec.get('kind') in ('failed', 'hung'))
    return DistributedFaultError(msg, failed=failed, gone=survey.gone, hung=survey.silent)


def run_with_fault_report(fn: Callable[[], T], *, work_dir: Optional[str] = None,
                          config_path: str = 'CONFIG',
                          reporter: Optional[FaultReporter] = None,
                          exit_deadline_s: Optional[float] = EXIT_DEADLINE_S) -> T:
    """Run ``fn`` (``runner.train``) on one rank of a distributed job and report faults.

    An exception of this rank's own is recorded in the rendezvous store (type, message,
    iteration) and re-raised. A communication error (a peer gone, a collective timeout) is
    turned into a :class:`DistributedFaultError` that names the failed / killed / hung ranks
    and the checkpoint to resume from (``work_dir/last_checkpoint``). In both cases SIGALRM ends
    the process ``exit_deadline_s`` later if it is still alive. The process group is left as is:
    DDP holds it, and gloo closes this rank's connections (which releases the peers) only when
    the process exits. Without an initialised process group (or MASTER_ADDR / MASTER_PORT) ``fn``
    runs as is.
    """
    if reporter is None:
        reporter = _default_reporter()
    if reporter is None:
        return fn()
    try:
        reporter.start()
    except Exception as e:  # no store to report to: train without
        logger.warning('rank %d: no fault reports (store %s:%d: %s)', reporter.rank,
                       reporter.host, reporter.port, e)
        return fn()
    try:
        result = fn()
    except BaseException as exc:
        reporter.handling = True
        _arm_exit_deadline(exit_deadline_s)
        gc.freeze()  # teardown without collecting the imports' objects (seconds on 2 cores)
        comm = is_communication_error(exc)
        reporter.record('peer' if comm else 'failed', exc)
        if not comm:
            if reporter.hosts_store:  # keep the store up until the others have read the record
                _survey_quietly(reporter)
            reporter.stop()
            raise
        error = fault_message(reporter, exc, work_dir, config_path)
        MMLogger.get_current_instance().error(str(error))
        reporter.stop()
        _flush_logs()
        raise error from exc
    reporter.record('done', None)
    reporter.stop()
    return result


def _survey_quietly(reporter: FaultReporter) -> None:
    try:
        reporter.survey(until_acked=True)
    except Exception as e:
        logger.debug('survey: %s', e)


def _default_reporter(hang_grace_s: float = HANG_GRACE_S) -> Optional[FaultReporter]:
    if not torch_dist.is_available() or not torch_dist.is_initialized():
        return None
    if torch_dist.get_world_size() < 2 or not all(
            os.environ.get(k) for k in ('MASTER_ADDR', 'MASTER_PORT')):
        return None
    return FaultReporter(torch_dist.get_rank(), torch_dist.get_world_size(),
                         os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']),
                         hang_grace_s=hang_grace_s)


def train_with_fault_report(runner: Any, config_path: Optional[str] = None,
                            hang_grace_s: float = HANG_GRACE_S) -> Any:
    """``runner.train()`` under :func:`run_with_fault_report`, with the iteration of each rank
    tracked by a hook. ``config_path``: the config named in the resume hint."""
    reporter = _default_reporter(hang_grace_s)
    if reporter is None:
        return runner.train()
    runner.register_hook(FaultProgressHook(reporter))
    config = config_path or getattr(runner.cfg, 'filename', None) or 'CONFIG'
    return run_with_fault_report(runner.train, work_dir=runner.work_dir, config_path=config,
                                 reporter=reporter)
