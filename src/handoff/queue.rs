//! The command queue: how NCCL's threads hand work to the reactor, and how the reactor
//! answers a caller that waits ([`Done`]/[`Signal`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use mio::Waker;
use parking_lot::Mutex;

use super::comm::{CommShared, ListenShared, PendingConnect, PendingListen, Rescue};
use super::operator::{DrainSource, ProcessStatus};
use super::request::Request;
use super::Error;
use crate::transport::memory::UserBuf;

/// How long [`CommandQueue::drive_until`] waits between turns: a turn that found the
/// reactor taken nudged its owner, who answers within this or leaves it free.
const DRIVE_WAIT: Duration = Duration::from_micros(100);

/// Work for the reactor.
#[derive(Debug)]
pub enum Command {
    /// Opens NCCL's listener on local NIC `nic`; the address peers connect to, or why
    /// there is none, goes to `reply`.
    Listen {
        nic: usize,
        shared: Arc<ListenShared>,
        reply: Arc<PendingListen>,
    },
    CloseListen {
        shared: Arc<ListenShared>,
    },
    /// Connects from local NIC `nic` to NCCL's listener at `to`.
    Connect {
        nic: usize,
        to: SocketAddr,
        /// The handle's token: the key of this handshake, never sent.
        token: [u8; 16],
        /// The listener's id and failover listeners, from the handle.
        rescue: Rescue,
        pending: Arc<PendingConnect>,
    },
    /// A send NCCL posted, matched to receive `seq` (`CommShared::claim`) and cut to its
    /// size.
    Send {
        comm: Arc<CommShared>,
        req: Arc<Request>,
        buf: UserBuf,
        seq: u64,
    },
    /// A receive of one to `MAX_RECVS` buffers, each with its tag (a grouped receive).
    Recv {
        comm: Arc<CommShared>,
        req: Arc<Request>,
        bufs: Vec<(UserBuf, i32)>,
    },
    /// Closes a comm; `done` is signalled once the reactor holds no reference to any of
    /// the comm's buffers, so NCCL may free them as soon as `closeSend`/`closeRecv` return.
    CloseComm {
        comm: Arc<CommShared>,
        done: Signal,
    },
    /// Fault injection: treat local NIC `nic` as cut (`up = false`) or restored.
    InjectLink {
        nic: usize,
        up: bool,
    },
    /// An operator drains (`on`) or undrains local NIC `nic`; what happened, or why it
    /// was refused, goes to `reply`.
    Drain {
        nic: usize,
        on: bool,
        source: DrainSource,
        reply: mpsc::SyncSender<Result<String, String>>,
    },
    /// What `railover status` shows of this process, to `reply`.
    Status {
        reply: mpsc::SyncSender<ProcessStatus>,
    },
    Shutdown,
    /// Test only: panics in the reactor's turn with this message, to prove that a reactor
    /// panic fails every caller instead of hanging. Pushed only by
    /// `plugin::inject_reactor_panic`, which no NCCL entry point calls.
    #[doc(hidden)]
    Panic(String),
}

/// A one-shot signal from the reactor to a waiting NCCL thread.
#[derive(Debug, Default)]
pub struct Done {
    flag: Mutex<bool>,
    cv: parking_lot::Condvar,
}

impl Done {
    pub fn signal(&self) {
        *self.flag.lock() = true;
        self.cv.notify_all();
    }

    /// The reactor's end of this signal.
    pub fn signaller(self: &Arc<Self>) -> Signal {
        Signal(self.clone())
    }

    /// Waits up to `limit`; `true` if signalled.
    pub fn wait(&self, limit: Duration) -> bool {
        let mut f = self.flag.lock();
        let end = Instant::now() + limit;
        while !*f {
            if self.cv.wait_until(&mut f, end).timed_out() {
                return *f;
            }
        }
        true
    }
}

/// The reactor's end of a [`Done`]: it signals when used or dropped, so a waiter is
/// released even when a reactor panic drops the command unrun.
#[derive(Debug)]
pub struct Signal(Arc<Done>);

impl Signal {
    /// Signals now; dropping it does the same.
    pub fn signal(self) {}
}

impl Drop for Signal {
    fn drop(&mut self) {
        self.0.signal();
    }
}

/// Runs a turn of the reactor on the calling thread, if nobody else is running one.
/// Never waits: a caller that finds the reactor taken goes on, and whoever holds it (or
/// the reactor thread, woken by `push`) serves what the caller queued.
pub(crate) trait Drive: Send + Sync {
    fn try_drive(&self, call: Call<'_>);
}

/// What a caller offering to drive is doing: NCCL's proxy loop posts and tests the
/// requests of all its comms in one sweep, and one turn per sweep serves them all.
#[derive(Clone, Copy)]
pub(crate) enum Call<'a> {
    /// `test` of a request of the comm with this sweep mark: a caller back at a comm it
    /// tested since the last turn has finished a sweep.
    Test(&'a AtomicU64),
    /// `isend`/`irecv`: the test that follows in the same sweep runs the turn.
    Post,
    /// Anything else (`connect`, `accept`, `close`): a turn if the reactor is free.
    Other,
}

/// The producers' side of the reactor.
pub struct CommandQueue {
    q: Mutex<VecDeque<Command>>,
    /// Commands queued and not yet taken; read without the lock by the parking check.
    pub(crate) len: AtomicUsize,
    pub(crate) parked: AtomicBool,
    /// The reactor has exited: nothing will process commands any more. Set under `q`'s
    /// lock, so a command is either taken by the reactor or refused by `push`.
    stopped: AtomicBool,
    /// Taken (and its eventfd closed) when the reactor exits: comms NCCL never closed keep
    /// this queue alive past `finalize`, and must not keep a file descriptor with it.
    waker: Mutex<Option<Waker>>,
    /// Set once, before `stopped`, when the reactor panicked: the panic's message.
    panic: OnceLock<String>,
    /// How a caller runs the reactor's turn itself (`RAILOVER_PROGRESS=caller`). Weak:
    /// the reactor holds this queue.
    driver: OnceLock<Weak<dyn Drive>>,
}

impl std::fmt::Debug for CommandQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandQueue")
            .field("len", &self.len)
            .field("parked", &self.parked)
            .field("stopped", &self.stopped)
            .field("panic", &self.panic)
            .field("driven_by_callers", &self.driver.get().is_some())
            .finish()
    }
}

impl CommandQueue {
    pub(crate) fn new(waker: Waker) -> CommandQueue {
        CommandQueue {
            q: Mutex::new(VecDeque::new()),
            len: AtomicUsize::new(0),
            parked: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            waker: Mutex::new(Some(waker)),
            panic: OnceLock::new(),
            driver: OnceLock::new(),
        }
    }

    /// Lets callers drive the reactor through `driver` from now on.
    pub(crate) fn driven_by(&self, driver: Weak<dyn Drive>) {
        let _ = self.driver.set(driver);
    }

    /// Runs a reactor turn on this thread if callers may and the reactor is free: what
    /// this caller queued is served now, with no hop to another thread. A no-op when
    /// progress is the reactor thread's alone, or the reactor is gone.
    pub fn drive(&self) {
        self.drive_for(Call::Other);
    }

    /// Waits up to `limit` for the answer to a command this caller queued (`answer`,
    /// asked to wait at most the time it is given), driving the reactor between looks.
    /// A caller blocked on its own command (`listen`, a close) runs the turn that serves
    /// it: the reactor thread keeps off the reactor while callers are active, so merely
    /// waiting would cost each such call the thread's hand-over time, and an all-to-all
    /// init's thousands of `listen` calls one after the other.
    pub fn drive_until<T>(
        &self,
        limit: Duration,
        mut answer: impl FnMut(Duration) -> Option<T>,
    ) -> Option<T> {
        let end = Instant::now() + limit;
        loop {
            self.drive();
            let left = end.saturating_duration_since(Instant::now());
            if let Some(v) = answer(left.min(DRIVE_WAIT)) {
                return Some(v);
            }
            if left.is_zero() {
                return None;
            }
        }
    }

    /// [`CommandQueue::drive`] from a call of NCCL's proxy loop ([`Call`]).
    pub(crate) fn drive_for(&self, call: Call<'_>) {
        if let Some(d) = self.driver.get().and_then(Weak::upgrade) {
            d.try_drive(call);
        }
    }

    /// Wakes the reactor thread if it is parked in `epoll` (a caller found the reactor
    /// taken by it and wants it handed over).
    pub(crate) fn nudge(&self) {
        if self.parked.swap(false, Ordering::SeqCst) {
            if let Some(w) = self.waker.lock().as_ref() {
                let _ = w.wake();
            }
        }
    }

    /// Queues a command; wakes the reactor only if it is parked. After the reactor has
    /// exited the command is refused instead: its request fails, its close completes.
    pub fn push(&self, c: Command) {
        {
            let mut q = self.q.lock();
            if self.stopped.load(Ordering::Acquire) {
                drop(q);
                refuse(c, self.stop_reason());
                return;
            }
            q.push_back(c);
        }
        // Dekker-style hand-off with the reactor's `park`: both sides write their flag
        // with SeqCst before reading the other's, so at least one sees the other.
        self.len.fetch_add(1, Ordering::SeqCst);
        self.nudge();
    }

    /// A queue no reactor serves, for unit tests of the objects that hold one.
    #[cfg(test)]
    pub(crate) fn for_tests(waker: Waker) -> CommandQueue {
        CommandQueue::new(waker)
    }

    /// The reactor thread has exited.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// The error every call gets once the reactor thread has panicked.
    pub fn panicked(&self) -> Option<Error> {
        self.panic.get().map(|_| {
            Error::Internal(
                "the railover reactor panicked (see the WARN that gives its message); \
                 nothing more can be sent or received until the plugin is finalised"
                    .into(),
            )
        })
    }

    /// `Err` once the reactor thread has panicked.
    pub fn check(&self) -> Result<(), Error> {
        self.panicked().map_or(Ok(()), Err)
    }

    fn stop_reason(&self) -> Error {
        self.panicked()
            .unwrap_or_else(|| Error::InvalidUsage("the plugin was finalised".into()))
    }

    pub(crate) fn take(&self) -> VecDeque<Command> {
        // Callers run a turn on every `test`: an empty queue costs no lock.
        if self.len.load(Ordering::SeqCst) == 0 {
            return VecDeque::new();
        }
        let cmds = std::mem::take(&mut *self.q.lock());
        self.len.fetch_sub(cmds.len(), Ordering::SeqCst);
        cmds
    }

    /// Commands the reactor took but leaves for a later turn, in order, ahead of anything
    /// pushed since: they stay the queue's, so a stop (or a panic) refuses them too.
    pub(crate) fn put_back(&self, mut cmds: VecDeque<Command>) {
        if cmds.is_empty() {
            return;
        }
        let mut q = self.q.lock();
        if self.stopped.load(Ordering::Acquire) {
            drop(q);
            let reason = self.stop_reason();
            cmds.into_iter().for_each(|c| refuse(c, reason.clone()));
            return;
        }
        self.len.fetch_add(cmds.len(), Ordering::SeqCst);
        cmds.append(&mut q);
        *q = cmds;
    }

    /// The reactor is exiting: refuse what is queued and what comes later, and close the
    /// waker's eventfd.
    pub(crate) fn stop(&self) {
        let left = {
            let mut q = self.q.lock();
            self.stopped.store(true, Ordering::Release);
            std::mem::take(&mut *q)
        };
        self.len.fetch_sub(left.len(), Ordering::SeqCst);
        let reason = self.stop_reason();
        left.into_iter().for_each(|c| refuse(c, reason.clone()));
        self.waker.lock().take();
    }

    /// The reactor panicked (on its own thread or a caller's) and its state is gone:
    /// record why, say it once, and refuse everything from now on.
    pub(crate) fn poison(&self, message: String) {
        if self.panic.set(message.clone()).is_ok() {
            let thread = std::thread::current();
            let on = thread.name().unwrap_or("an unnamed thread");
            tracing::warn!(
                "railover: the reactor panicked (on thread {on}): {message}; every request \
                 in flight and every later call fails with ncclInternalError until the \
                 plugin is finalised"
            );
        }
        self.stop();
    }
}

/// A command no reactor will run: nobody is left waiting on it.
fn refuse(c: Command, reason: Error) {
    match c {
        Command::Send { req, .. } | Command::Recv { req, .. } => req.fail(reason),
        Command::CloseComm { done, .. } => done.signal(),
        Command::Connect { pending, .. } => *pending.result.lock() = Some(Err(reason)),
        Command::Listen { reply, .. } => reply.finish(Err(reason)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use mio::{Poll, Token};

    use super::*;
    use crate::handoff::comm::Side;

    #[test]
    fn a_stopped_queue_refuses_commands_and_closes_its_waker() {
        let poll = Poll::new().unwrap();
        let q = Arc::new(CommandQueue::new(
            Waker::new(poll.registry(), Token(0)).unwrap(),
        ));
        let comm = Arc::new(CommShared::new(
            Side::Send,
            0,
            q.clone(),
            0,
            Duration::from_secs(10),
        ));
        let queued = Arc::new(Done::default());
        q.push(Command::CloseComm {
            comm: comm.clone(),
            done: queued.signaller(),
        });
        q.stop();
        assert!(queued.wait(Duration::ZERO), "released by the stop");
        assert!(q.waker.lock().is_none(), "the eventfd is closed");
        let later = Arc::new(Done::default());
        q.parked.store(true, Ordering::SeqCst);
        q.push(Command::CloseComm {
            comm,
            done: later.signaller(),
        });
        assert!(later.wait(Duration::ZERO), "refused at once");
        // A `listen` waiting for its address is answered too, never left to time out.
        let reply = push_listen(&q);
        assert!(matches!(
            reply.wait(Duration::ZERO),
            Some(Err(Error::InvalidUsage(_)))
        ));
        assert_eq!(q.len.load(Ordering::SeqCst), 0);
        assert!(q.take().is_empty());
    }

    #[test]
    fn a_poisoned_queue_fails_what_is_queued_and_what_comes_later_as_internal() {
        let poll = Poll::new().unwrap();
        let q = Arc::new(CommandQueue::new(
            Waker::new(poll.registry(), Token(0)).unwrap(),
        ));
        let comm = Arc::new(CommShared::new(
            Side::Send,
            0,
            q.clone(),
            0,
            Duration::from_secs(10),
        ));
        let pending = Arc::new(PendingConnect::default());
        let queued = Arc::new(Request::new(comm.clone()));
        let close = Arc::new(Done::default());
        let empty = || UserBuf::of_slice(Vec::leak(Vec::new()));
        q.push(Command::Send {
            comm: comm.clone(),
            req: queued.clone(),
            buf: empty(),
            seq: 0,
        });
        assert_eq!(q.check(), Ok(()));
        q.poison("on purpose".into());
        fn internal<T>(r: Result<T, Error>) -> bool {
            matches!(r, Err(Error::Internal(_)))
        }
        assert!(internal(queued.status()), "{:?}", queued.status());
        assert!(internal(q.check()));
        q.push(Command::CloseComm {
            comm: comm.clone(),
            done: close.signaller(),
        });
        assert!(close.wait(Duration::ZERO), "a close is released at once");
        q.push(Command::Connect {
            nic: 0,
            to: "127.0.0.1:9".parse().unwrap(),
            token: [0; 16],
            rescue: Rescue::default(),
            pending: pending.clone(),
        });
        assert!(internal(pending.result.lock().take().unwrap()));
    }

    #[test]
    fn commands_put_back_come_first_in_order_and_a_stop_refuses_them() {
        let poll = Poll::new().unwrap();
        let q = CommandQueue::new(Waker::new(poll.registry(), Token(0)).unwrap());
        let connect = |port: u16| {
            let pending = Arc::new(PendingConnect::default());
            let c = Command::Connect {
                nic: 0,
                to: std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                token: [0; 16],
                rescue: Rescue::default(),
                pending: pending.clone(),
            };
            (c, pending)
        };
        let port = |c: &Command| match c {
            Command::Connect { to, .. } => to.port(),
            _ => unreachable!("only connects here"),
        };
        let (a, _) = connect(1);
        let (b, _) = connect(2);
        q.push(a);
        q.push(b);
        let mut taken = q.take();
        assert_eq!(taken.len(), 2);
        let first = taken.pop_front().unwrap();
        assert_eq!(port(&first), 1);
        // Pushed while the reactor held the rest: it goes after them.
        let (c, _) = connect(3);
        q.push(c);
        q.put_back(taken);
        assert_eq!(q.len.load(Ordering::SeqCst), 2);
        let order: Vec<u16> = q.take().iter().map(port).collect();
        assert_eq!(order, [2, 3]);
        assert_eq!(q.len.load(Ordering::SeqCst), 0);
        // Put back, then the reactor stops: the connect is refused, not left pending.
        let (d, pending) = connect(4);
        q.put_back([d].into());
        q.stop();
        assert!(matches!(*pending.result.lock(), Some(Err(_))));
        let (e, late) = connect(5);
        q.put_back([e].into());
        assert!(
            matches!(*late.result.lock(), Some(Err(_))),
            "after the stop too"
        );
    }

    #[test]
    fn a_dropped_signal_releases_its_waiter() {
        let done = Arc::new(Done::default());
        let s = done.signaller();
        assert!(!done.wait(Duration::ZERO));
        drop(s);
        assert!(
            done.wait(Duration::ZERO),
            "a command lost in a panic still signals"
        );
    }

    /// Queues a `Listen` of NCCL listener 1 on NIC 0; returns where its answer comes.
    fn push_listen(q: &Arc<CommandQueue>) -> Arc<PendingListen> {
        let reply = Arc::new(PendingListen::default());
        q.push(Command::Listen {
            nic: 0,
            shared: Arc::new(ListenShared {
                id: 1,
                token: [0; 16],
                nic: 0,
                ready: Mutex::new(VecDeque::new()),
                queue: q.clone(),
            }),
            reply: reply.clone(),
        });
        reply
    }

    /// A driver that serves the queue on the caller's thread: its turn answers every
    /// `Listen` queued so far, as the reactor's would.
    struct Serving(Arc<CommandQueue>, AtomicUsize);

    impl Drive for Serving {
        fn try_drive(&self, _call: Call<'_>) {
            self.1.fetch_add(1, Ordering::Relaxed);
            for c in self.0.take() {
                if let Command::Listen { reply, .. } = c {
                    reply.finish(Ok("127.0.0.1:1".parse().unwrap()));
                }
            }
        }
    }

    #[test]
    fn a_caller_waiting_on_its_own_command_runs_the_turn_that_answers_it() {
        let poll = Poll::new().unwrap();
        let q = Arc::new(CommandQueue::new(
            Waker::new(poll.registry(), Token(0)).unwrap(),
        ));
        let driver = Arc::new(Serving(q.clone(), AtomicUsize::new(0)));
        let weak: Weak<dyn Drive> = Arc::downgrade(&driver) as Weak<Serving>;
        q.driven_by(weak);
        let reply = push_listen(&q);
        // Nobody else serves this queue: only the caller's own turn can answer, and
        // without it the wait would end empty-handed at its limit.
        let got = q.drive_until(Duration::from_secs(30), |t| reply.wait(t));
        assert!(matches!(got, Some(Ok(_))), "{got:?}");
        assert_eq!(
            driver.1.load(Ordering::Relaxed),
            1,
            "one turn, before any wait"
        );
        // An answer that never comes ends the wait at its limit, having driven.
        let never = q.drive_until(Duration::ZERO, |_| None::<()>);
        assert!(never.is_none());
        assert_eq!(driver.1.load(Ordering::Relaxed), 2);
    }
}
