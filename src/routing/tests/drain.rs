//! Drains on the router's virtual clock: planned moves off a NIC, ours or the peer's, the
//! refusal of a drain that would strand a comm, and the way home after an undrain.

use super::*;

fn drained_moves(moves: &[Move]) -> usize {
    moves
        .iter()
        .filter(|m| m.reason == MoveReason::Drain)
        .count()
}

#[test]
fn a_drain_moves_every_lane_off_the_nic_in_planned_moves_and_counts_no_failover() {
    let mut sim = router_with_rails(4, 3, config(7));
    assert_eq!(sim.router.check_drain(NicId(0), sim.now), Ok(()));
    sim.router.handle_drain(NicId(0), sim.now);
    sim.drive();
    let moves = sim.take_moves();
    assert_eq!(moves.len(), 3, "{moves:?}");
    assert_eq!(drained_moves(&moves), 3);
    for m in &moves {
        assert_eq!(m.from, pair(0, 0));
        assert_ne!(m.to.local, NicId(0), "{m:?}");
    }
    let stats = sim.router.stats();
    assert_eq!(stats.drain_moves, 3);
    assert_eq!(stats.failovers.get(FailReason::LinkDown), 0);
    assert_eq!(stats.failovers.get(FailReason::Timeout), 0);
    assert_eq!(sim.local_loads().get(&0).copied().unwrap_or(0), 0);
    // Spread over the survivors, not piled on one.
    let targets: BTreeSet<Pair> = moves.iter().map(|m| m.to).collect();
    assert_eq!(targets.len(), 3, "{moves:?}");
    // Repeats change nothing.
    sim.router.handle_drain(NicId(0), sim.now);
    sim.drive();
    assert!(sim.take_moves().is_empty());
}

#[test]
fn a_drained_nic_is_no_candidate_for_a_failover_elsewhere() {
    let mut sim = router_with_rails(3, 2, config(1));
    sim.router.handle_drain(NicId(0), sim.now);
    sim.drive();
    sim.take_moves();
    sim.fail_lane(0, 1, FailReason::Timeout);
    let moves = sim.take_moves();
    assert!(!moves.is_empty());
    for m in &moves {
        assert_eq!(m.reason, MoveReason::Failover(FailReason::Timeout));
        assert_ne!(
            m.to.local,
            NicId(0),
            "a failover went to the drained NIC: {m:?}"
        );
    }
}

#[test]
fn a_drain_that_would_strand_a_comm_is_refused_saying_why_and_changes_nothing() {
    let mut sim = router_with_rails(2, 1, config(0));
    sim.router.handle_drain(NicId(0), sim.now);
    sim.drive();
    sim.take_moves();
    let refused = sim.router.check_drain(NicId(1), sim.now).unwrap_err();
    assert_eq!(refused.nic, NicId(1));
    let text = refused.to_string();
    assert!(text.contains("NIC drained"), "{text}");
    // With NIC 0 down instead of drained, the reason names the carrier.
    let mut sim = router_with_rails(2, 1, config(0));
    sim.nic_down(0);
    sim.take_moves();
    let text = sim
        .router
        .check_drain(NicId(1), sim.now)
        .unwrap_err()
        .to_string();
    assert!(text.contains("local NIC down"), "{text}");
    // A NIC no comm runs on may always be drained.
    let sim = router_with_rails(2, 0, config(0));
    assert_eq!(sim.router.check_drain(NicId(1), sim.now), Ok(()));
}

#[test]
fn an_undrained_nic_gets_its_lanes_back_only_through_the_failback_probes() {
    let mut sim = router_with_rails(2, 1, config(0));
    sim.router.handle_drain(NicId(0), sim.now);
    sim.drive();
    assert_eq!(drained_moves(&sim.take_moves()), 1);
    assert_eq!(
        sim.router.current_pair(CommId(0), LaneId(0)),
        Some(pair(1, 1))
    );
    // While drained, its pairs are never probed and nothing moves home.
    sim.advance_to(ms(10_000));
    assert!(sim.take_moves().is_empty());
    assert!(
        !sim.probe_log.iter().any(|(_, p)| p.pair.local == NicId(0)),
        "a drained NIC was probed: {:?}",
        sim.probe_log
    );
    sim.router.handle_undrain(NicId(0), sim.now);
    sim.drive();
    assert!(sim.take_moves().is_empty(), "undrain moved lanes at once");
    let k = sim.router.config().failback_probes_k;
    let interval = sim.router.config().failback_interval;
    sim.advance_to(ms(10_000) + interval * (k + 1));
    let moves = sim.take_moves();
    assert_eq!(
        moves,
        vec![Move {
            comm: CommId(0),
            lane: LaneId(0),
            from: pair(1, 1),
            to: pair(0, 0),
            reason: MoveReason::Failback,
        }]
    );
    let good_probes = (sim.probe_log.iter())
        .filter(|(t, p)| p.pair == pair(0, 0) && *t >= sim.at(ms(10_000)))
        .count();
    assert_eq!(good_probes as u32, k);
}

#[test]
fn a_peer_drained_nic_is_left_by_every_lane_to_it_and_avoided_until_cleared() {
    let mut sim = router_with_rails(3, 2, config(3));
    let now = sim.now;
    assert!(sim.router.handle_remote_drained(PEER, &[NicId(0)], now));
    sim.drive();
    let moves = sim.take_moves();
    assert_eq!(drained_moves(&moves), 2, "{moves:?}");
    assert!(moves.iter().all(|m| m.to.remote != NicId(0)), "{moves:?}");
    // The same news again is no news.
    assert!(!sim.router.handle_remote_drained(PEER, &[NicId(0)], now));
    // A failover elsewhere avoids the peer's drained NIC.
    sim.fail_lane(1, 1, FailReason::Timeout);
    assert!(sim.take_moves().iter().all(|m| m.to.remote != NicId(0)));
    // Another peer's NIC 0 is not drained.
    let other = Pair {
        peer: PeerId(9),
        ..pair(0, 0)
    };
    assert!(!sim.router.drained(other));
    assert!(sim.router.drained(pair(1, 0)));
    assert!(sim.router.handle_remote_drained(PEER, &[], now));
    assert!(!sim.router.drained(pair(1, 0)));
}

#[test]
fn a_comm_opened_on_a_drained_nic_moves_off_it_from_the_start() {
    let mut sim = router_with_rails(3, 1, config(5));
    sim.router.handle_drain(NicId(2), sim.now);
    sim.drive();
    sim.take_moves();
    sim.add(7, rails_spec(3, &[(2, 2)]));
    let moves = sim.take_moves();
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!(moves[0].comm, CommId(7));
    assert_eq!(moves[0].reason, MoveReason::Drain);
    assert_ne!(moves[0].to.local, NicId(2));
}

#[test]
fn a_planned_move_with_nowhere_healthy_to_go_waits_on_its_pair_and_never_gives_up() {
    let one_lane = || {
        let mut sim = Sim::new(config(0));
        sim.add(0, rails_spec(2, &[(0, 0)]));
        sim
    };
    let mut sim = one_lane();
    sim.dead_local.insert(1);
    sim.router.handle_drain(NicId(0), sim.now);
    sim.drive();
    assert!(sim.take_moves().is_empty());
    let giveup = sim.router.config().giveup;
    sim.advance_to(giveup * 3);
    assert!(sim.take_moves().is_empty());
    assert!(sim.events.is_empty(), "{:?}", sim.events);
    assert_eq!(
        sim.router.current_pair(CommId(0), LaneId(0)),
        Some(pair(0, 0))
    );
    // The backup heals: the next re-probe lets the lane leave.
    sim.dead_local.clear();
    sim.advance_to(giveup * 3 + sim.router.config().retry_max * 2);
    let moves = sim.take_moves();
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!(moves[0].reason, MoveReason::Drain);
    assert_eq!(moves[0].to.local, NicId(1));
    // Undrained while waiting: the lane simply stays.
    let mut sim = one_lane();
    sim.dead_local.insert(1);
    sim.router.handle_drain(NicId(0), sim.now);
    sim.drive();
    sim.router.handle_undrain(NicId(0), sim.now);
    sim.drive();
    sim.dead_local.clear();
    sim.advance_to(giveup * 2);
    assert!(sim.take_moves().is_empty());
    assert_eq!(sim.router.displaced_comms(), 0);
}

#[test]
fn a_lane_waiting_to_leave_a_drained_pair_that_fails_moves_as_a_failover() {
    let mut sim = Sim::new(config(0));
    sim.add(0, rails_spec(2, &[(0, 0)]));
    sim.auto_probe = false;
    sim.router.handle_drain(NicId(0), sim.now);
    sim.drive();
    assert!(
        sim.take_moves().is_empty(),
        "waits for the probe of its backup"
    );
    sim.fail_lane(0, 0, FailReason::Timeout);
    for p in std::mem::take(&mut sim.pending_probes) {
        sim.router.handle_probe(p, true, sim.now);
    }
    sim.drive();
    let moves = sim.take_moves();
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!(moves[0].reason, MoveReason::Failover(FailReason::Timeout));
}
