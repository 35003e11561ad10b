//! The reactor driven by its caller instead of its own thread and `epoll`, for the
//! deterministic simulation: the caller passes virtual time, and every lane and listener
//! counts as ready each step (readiness is only a hint to the reactor, so this is the
//! same logic, merely polled more often).
#![cfg_attr(not(test), allow(dead_code))] // only the simulation tier drives it

use std::io;
use std::sync::Arc;
use std::time::Instant;

use mio::Token;

use super::{CommandQueue, Reactor, Setup, LISTENER_BIT};
use crate::transport::Fabric;

/// A reactor stepped by hand.
pub(crate) struct Driven<F: Fabric>(Reactor<F>);

impl<F: Fabric> Driven<F> {
    pub(crate) fn new(setup: Setup, fabric: F) -> io::Result<Driven<F>> {
        Reactor::new(setup, fabric).map(Driven)
    }

    /// Where NCCL's side pushes its commands.
    pub(crate) fn queue(&self) -> &Arc<CommandQueue> {
        &self.0.queue
    }

    /// What a poll would report: the lanes `ready` says have an event (every one, for a
    /// level-triggered view; those with news, for an edge-triggered one) and every
    /// listener. Taken before the turn, as a reactor's poll returns before it acts.
    pub(crate) fn poll(&self, mut ready: impl FnMut(&F::Lane) -> bool) -> Vec<Token> {
        let r = &self.0;
        (r.io.lanes.iter().enumerate())
            .filter(|(_, s)| s.as_ref().is_some_and(&mut ready))
            .map(|(k, _)| Token(k))
            .chain(r.listeners.iter().map(|(k, _)| Token(k | LISTENER_BIT)))
            .collect()
    }

    /// Local NIC `i`'s running stripes (router lanes), from the routes the engine published.
    pub(crate) fn stripes_per_nic(&self) -> Vec<(u32, u32)> {
        let routes = self.0.engine.routes().load();
        (routes.local_nics.iter())
            .map(|n| (n.nic.0, n.lanes))
            .collect()
    }

    /// Whether `f` holds for any lane.
    pub(crate) fn any_lane(&self, f: impl FnMut(&F::Lane) -> bool) -> bool {
        self.0.io.lanes.iter().flatten().any(f)
    }

    /// One turn at `now`: commands, the lanes and listeners of `ready` (from
    /// [`Driven::poll`]), every timer that is due.
    pub(crate) fn step(&mut self, now: Instant, ready: &[Token]) {
        let r = &mut self.0;
        r.before_poll(now);
        if r.shutdown {
            return;
        }
        r.after_poll(ready, now);
    }

    /// Lanes holding bytes that no event will announce and that the reactor has not
    /// put down to read next turn: each would sit until its peer happens to send more.
    pub(crate) fn unannounced(&self) -> Vec<usize> {
        let io = &self.0.io;
        (io.lanes.iter().enumerate())
            .filter(|(k, s)| {
                s.as_ref().is_some_and(|l| io.fabric.unread(l)) && !io.unread.contains(k)
            })
            .map(|(k, _)| k)
            .collect()
    }

    /// The reactor has lanes to read before it may wait (as its own loop polls with a
    /// zero timeout then).
    pub(crate) fn has_unread(&self) -> bool {
        !self.0.io.unread.is_empty()
    }

    /// The earliest time a timer is due; the simulation's clock may jump there.
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.0.next_wakeup()
    }

    /// Local NIC `nic`'s carrier changed, as netlink would report it.
    pub(crate) fn carrier(&mut self, nic: usize, up: bool, now: Instant) {
        self.0.carrier(nic, up, now);
    }

    /// An operator drains (`on`) or undrains local NIC `nic`, as the control socket
    /// would ask: what happened, or why it was refused.
    pub(crate) fn drain(&mut self, nic: usize, on: bool, now: Instant) -> Result<String, String> {
        self.0.drain(nic, on, now)
    }

    /// Whether any comm has a request outstanding.
    pub(crate) fn busy(&self) -> bool {
        self.0.requests_in_flight()
    }

    /// Closes everything, as the reactor thread does when it exits.
    pub(crate) fn finish(mut self) {
        self.0.close_everything();
        self.0.queue.stop();
    }
}
