//! Striping weighted by what each survivor can carry: link speeds, measured rates and PCIe
//! paths, against equal striping, on the router's virtual clock.

use super::*;

/// Stripes per comm, as the engine cuts a send comm on a 4-NIC node (two per other NIC).
const STRIPES: usize = 6;

/// `per_nic` comms on each of `n` NICs (rail `i` on both sides, all PIX), each cut into
/// [`STRIPES`] stripes on its NIC's own pair.
fn striped(n: u32, per_nic: usize, config: RouterConfig, speeds: &[u64]) -> Sim {
    let mut sim = Sim::new(config);
    for (i, &mbps) in speeds.iter().enumerate() {
        sim.router.set_link_speed(NicId(i as u32), mbps);
    }
    for c in 0..n as usize * per_nic {
        let nic = (c % n as usize) as u32;
        sim.add(c, rails_spec(n, &[(nic, nic); STRIPES]));
    }
    sim
}

/// The rate every comm of a lockstep collective runs at, relative: each NIC carries its
/// stripes' share of their comms, so the NIC with the least capacity per stripe paces all.
fn lockstep_rate(loads: &BTreeMap<u32, u32>, capacity: &[f64]) -> f64 {
    (loads.iter())
        .filter(|(_, &l)| l > 0)
        .map(|(&nic, &l)| capacity[nic as usize] * STRIPES as f64 / f64::from(l))
        .fold(f64::INFINITY, f64::min)
}

/// What the slowest comm keeps when NIC 0 fails: the lockstep rate after over before.
fn kept_when_nic0_fails(sim: &mut Sim, capacity: &[f64]) -> (f64, BTreeMap<u32, u32>) {
    let before = lockstep_rate(&sim.local_loads(), capacity);
    sim.nic_down(0);
    let after = sim.local_loads();
    (lockstep_rate(&after, capacity) / before, after)
}

fn equal(seed: u64) -> RouterConfig {
    RouterConfig {
        weighted: false,
        ..config(seed)
    }
}

#[test]
fn a_failed_nic_goes_to_the_survivor_that_can_carry_it() {
    // The example of 4 NICs, 2 comms each: the failed NIC and one survivor run at 200,
    // two survivors at 100. Every comm runs at 50 before (the 100s pace it); all of the
    // failed NIC's stripes on the 200 survivor keeps 1.0, equal thirds keep 0.75.
    let capacity = [200.0, 200.0, 100.0, 100.0];
    for seed in [0u64, 1, 42] {
        let mut sim = striped(4, 2, config(seed), &[200, 200, 100, 100]);
        let (kept, after) = kept_when_nic0_fails(&mut sim, &capacity);
        assert_eq!(
            after,
            BTreeMap::from([(0, 0), (1, 24), (2, 12), (3, 12)]),
            "seed {seed}"
        );
        assert!((kept - 1.0).abs() < 1e-9, "seed {seed}: kept {kept}");

        let mut sim = striped(4, 2, equal(seed), &[200, 200, 100, 100]);
        let (kept, after) = kept_when_nic0_fails(&mut sim, &capacity);
        assert_eq!(after, BTreeMap::from([(0, 0), (1, 16), (2, 16), (3, 16)]));
        assert!(
            (kept - 0.75).abs() < 1e-9,
            "seed {seed}: equal striping kept {kept}"
        );
    }
}

#[test]
fn halves_of_a_share_split_a_comm_over_two_fast_survivors() {
    // One comm per NIC at 200/150/150/100: the 100 paces the collective. The failed NIC's
    // comm fits on the two 150s in halves (1.0); in thirds of stripes one of them would
    // take two (0.9), and equal striping loads the 100 (0.75).
    let capacity = [200.0, 150.0, 150.0, 100.0];
    let mut sim = striped(4, 1, config(3), &[200, 150, 150, 100]);
    let (kept, after) = kept_when_nic0_fails(&mut sim, &capacity);
    assert_eq!(after, BTreeMap::from([(0, 0), (1, 9), (2, 9), (3, 6)]));
    assert!((kept - 1.0).abs() < 1e-9, "kept {kept}");
    let mut sim = striped(4, 1, equal(3), &[200, 150, 150, 100]);
    let (kept, _) = kept_when_nic0_fails(&mut sim, &capacity);
    assert!((kept - 0.75).abs() < 1e-9, "equal striping kept {kept}");
}

/// Feeds every NIC one sample a 100 ms for `samples`: `mbit[i]` Mbit/s, saturated where
/// `saturated[i]`.
fn traffic(sim: &mut Sim, mbit: &[f64], saturated: &[bool], samples: u32) {
    for _ in 0..samples {
        let t = sim.now + ms(100);
        sim.now = t;
        for (i, (&m, &s)) in mbit.iter().zip(saturated).enumerate() {
            let bytes = (m * 1e6 / 8.0 * 0.1) as u64;
            sim.router.handle_nic_sample(NicId(i as u32), bytes, s, t);
        }
        sim.drive();
    }
}

#[test]
fn measured_rates_weigh_survivors_whose_link_speed_says_nothing() {
    // Every NIC reports 10 Gb/s (a shaper is invisible to sysfs). Lockstep traffic at 100
    // Mbit/s per NIC backs up NICs 2 and 3 (they pace the collective) and not 0 or 1: the
    // backed-up NICs show what they carry, and the failed NIC's stripes go to NIC 1.
    let mut sim = striped(4, 2, config(5), &[10_000; 4]);
    traffic(&mut sim, &[100.0; 4], &[false, false, true, true], 10);
    let c = |nic| sim.router.capacity(NicId(nic), sim.now).unwrap() * 8.0 / 1e6;
    assert_eq!(c(1), 10_000.0);
    assert!((c(2) - 100.0).abs() < 1.0, "{}", c(2));
    let (_, after) = kept_when_nic0_fails(&mut sim, &[200.0, 200.0, 100.0, 100.0]);
    assert_eq!(after, BTreeMap::from([(0, 0), (1, 24), (2, 12), (3, 12)]));
}

#[test]
fn a_short_backlog_or_unsaturated_traffic_weighs_nothing() {
    let mut sim = striped(4, 2, config(5), &[10_000; 4]);
    // Backed up for 300 ms only (a burst), then flowing freely.
    traffic(&mut sim, &[100.0; 4], &[false, false, true, true], 3);
    traffic(&mut sim, &[100.0; 4], &[false; 4], 5);
    let (_, after) = kept_when_nic0_fails(&mut sim, &[1.0; 4]);
    assert_eq!(after, BTreeMap::from([(0, 0), (1, 16), (2, 16), (3, 16)]));
}

#[test]
fn equal_nics_measured_a_few_per_cent_apart_share_equally() {
    // All four saturated at 200 Mbit/s, give or take 3 %: shares stay even.
    for seed in [0u64, 1, 2, 3] {
        let mut sim = striped(4, 2, config(seed), &[10_000; 4]);
        traffic(&mut sim, &[200.0, 194.0, 206.0, 197.0], &[true; 4], 10);
        let (kept, after) = kept_when_nic0_fails(&mut sim, &[1.0; 4]);
        assert_eq!(
            after,
            BTreeMap::from([(0, 0), (1, 16), (2, 16), (3, 16)]),
            "seed {seed}"
        );
        assert!((kept - 0.75).abs() < 1e-9);
    }
}

#[test]
fn a_nic_behind_the_host_bridge_takes_less_than_one_behind_the_gpus_switch() {
    // Equal links; for this comm's GPU NIC 2 is across the host bridge (PHB). NCCL
    // measured 234 of 400 Gb/s there: the failed NIC's stripes favour NICs 1 and 3.
    let mut sim = Sim::new(config(11));
    let spec = CommSpec {
        peer: PEER,
        local_nics: vec![
            local(0, Some(0), Some(PathType::Pix)),
            local(1, Some(1), Some(PathType::Pix)),
            local(2, Some(2), Some(PathType::Phb)),
            local(3, Some(3), Some(PathType::Pxb)),
        ],
        remote_nics: (0..4).map(|i| remote(i, Some(i))).collect(),
        lanes: vec![(NicId(0), NicId(0)); STRIPES],
    };
    sim.add(0, spec);
    sim.nic_down(0);
    let after = sim.local_loads();
    let on = |nic| after.get(&nic).copied().unwrap_or(0);
    assert_eq!(on(1) + on(2) + on(3), STRIPES as u32);
    assert!(on(2) > 0 && on(2) < on(1) && on(2) < on(3), "{after:?}");
}

/// [`striped`] where the peer announced its NICs' link speeds (`remote`) and this node's
/// are `local` (empty: unknown).
fn striped_to_a_peer_of(remote: &[u64], local: &[u64], config: RouterConfig) -> Sim {
    let n = remote.len() as u32;
    let mut sim = Sim::new(config);
    for (i, &mbps) in local.iter().enumerate() {
        sim.router.set_link_speed(NicId(i as u32), mbps);
    }
    for c in 0..2 * n as usize {
        let nic = (c % n as usize) as u32;
        let mut spec = rails_spec(n, &[(nic, nic); STRIPES]);
        for (y, &mbps) in spec.remote_nics.iter_mut().zip(remote) {
            y.speed_mbps = Some(mbps);
        }
        sim.add(c, spec);
    }
    sim
}

#[test]
fn the_peers_announced_link_speeds_weigh_the_remote_end_of_each_pair() {
    // The example with the slow ports at the peer: this node's NICs are all alike
    // (unknown, or all 10 Gb/s like the testbed's veths, or 400 Gb/s), so the remote end
    // is each pair's bottleneck and the failed NIC's stripes go to the 200 survivor.
    let capacity = [200.0, 200.0, 100.0, 100.0];
    for local in [&[][..], &[10_000; 4], &[400_000; 4]] {
        let mut sim = striped_to_a_peer_of(&[200, 200, 100, 100], local, config(5));
        let (kept, after) = kept_when_nic0_fails(&mut sim, &capacity);
        assert_eq!(
            after,
            BTreeMap::from([(0, 0), (1, 24), (2, 12), (3, 12)]),
            "local speeds {local:?}"
        );
        assert!((kept - 1.0).abs() < 1e-9, "kept {kept}");
    }
    // A slow local NIC still counts where it is the slower end: 200 Mb/s peers behind
    // local NICs of which NIC 1 runs at 100.
    let mut sim = striped_to_a_peer_of(&[200; 4], &[200, 100, 200, 200], config(5));
    sim.nic_down(0);
    let after = sim.local_loads();
    assert!(after[&1] < after[&2] && after[&1] < after[&3], "{after:?}");
    // Equal weights ignore what the peer says.
    let mut sim = striped_to_a_peer_of(&[200, 200, 100, 100], &[], equal(5));
    let (_, after) = kept_when_nic0_fails(&mut sim, &capacity);
    assert_eq!(after, BTreeMap::from([(0, 0), (1, 16), (2, 16), (3, 16)]));
}

/// A second of traffic in which NIC 2 backs up at 100 Mbit/s and NICs 1 and 3 flow freely
/// at the same rate (NIC 0 is down).
fn nic2_backs_up(sim: &mut Sim) {
    let saturated = [false, false, true, false];
    traffic(sim, &[0.0, 100.0, 100.0, 100.0], &saturated, 10);
}

fn rebalanced(moves: &[Move]) -> usize {
    (moves.iter())
        .filter(|m| m.reason == MoveReason::Rebalance)
        .count()
}

#[test]
fn a_backup_found_slow_hands_its_moved_stripes_to_one_that_is_not() {
    // Equal links, one comm each: NIC 0's stripes go two to each survivor. Then NIC 2
    // backs up at 100 Mbit/s while 1 and 3 flow freely: the two stripes that failed over
    // onto NIC 2 move on, planned, and NIC 2's own comm stays where NCCL put it.
    let mut sim = striped(4, 1, config(2), &[10_000; 4]);
    sim.nic_down(0);
    assert_eq!(
        sim.local_loads(),
        BTreeMap::from([(0, 0), (1, 8), (2, 8), (3, 8)])
    );
    sim.take_moves();
    nic2_backs_up(&mut sim);
    let moves = sim.take_moves();
    assert_eq!(rebalanced(&moves), 2, "{moves:?}");
    for m in &moves {
        assert_eq!(m.from.local, NicId(2));
        assert_ne!(m.to.local, NicId(2));
        assert_eq!(m.comm, CommId(0), "only the failed NIC's comm moved: {m:?}");
    }
    let after = sim.local_loads();
    assert_eq!(after[&2], 6, "{after:?}");
    assert_eq!(after[&1] + after[&3], 18, "{after:?}");
    assert_eq!(sim.router.stats().rebalance_moves, 2);
    // Measured again at the same rate: nothing more moves.
    nic2_backs_up(&mut sim);
    assert_eq!(rebalanced(&sim.take_moves()), 0);
}

#[test]
fn a_small_shortfall_moves_nothing_and_equal_weights_never_rebalance() {
    // All four measured at 200 Mbit/s, NIC 0 fails (two stripes to each survivor), then
    // NIC 2 shows 180: the gain of a move is below the margin.
    let mut sim = striped(4, 1, config(4), &[10_000; 4]);
    traffic(&mut sim, &[200.0; 4], &[true; 4], 10);
    sim.nic_down(0);
    sim.take_moves();
    traffic(
        &mut sim,
        &[0.0, 200.0, 180.0, 200.0],
        &[false, true, true, true],
        10,
    );
    assert_eq!(rebalanced(&sim.take_moves()), 0);
    // With equal weights a NIC found slow changes nothing.
    let mut sim = striped(4, 1, equal(2), &[10_000; 4]);
    sim.nic_down(0);
    sim.take_moves();
    nic2_backs_up(&mut sim);
    assert_eq!(rebalanced(&sim.take_moves()), 0);
}
