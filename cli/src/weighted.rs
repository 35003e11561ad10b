//! `railover sim --lockstep --speeds …`: what a lockstep collective keeps when NIC 0 fails
//! and the NICs are not equal, with the failed NIC's stripes placed by railover's own
//! router (capacity-weighted, or equal with `RAILOVER_STRIPE_WEIGHTS=equal`), beside the
//! capacity-optimal share and NCCL's native failover.
//!
//! The model: C comms over N NICs (comm c on NIC c mod N), each cut into 2(N−1) stripes as
//! the plugin cuts a send comm, all moving equal messages in lockstep. A NIC carrying
//! stripes carries their share of their comms, so the NIC with the least capacity per
//! comm it carries paces every comm. The router is the plugin's: same selection, same
//! tie-breaks, its link speeds set from `--speeds`, every probe answered good.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Instant;

use railover::routing::{
    CommId, CommSpec, LocalNic, NicId, PeerId, RemoteNic, Router, RouterConfig,
};
use serde::Serialize;

/// One row of the weighted lockstep table.
#[derive(Debug, Clone, Serialize)]
pub struct WeightedRow {
    /// Mbit/s of each NIC; NIC 0 fails.
    pub speeds: Vec<u64>,
    pub comms: u32,
    /// The largest equal per-comm rate the survivors can carry (comms on healthy NICs
    /// staying where they are), over the rate before.
    pub optimal: f64,
    /// railover's router weighing survivors by capacity (the default).
    pub weighted: f64,
    /// railover's router with every survivor counted equal.
    pub equal: f64,
    /// NCCL's native port failover: the failed NIC's comms onto one survivor (the one
    /// that keeps the most).
    pub native: f64,
}

/// The rate (relative) at which comms in lockstep run when NIC `i` carries `load[i]` comms'
/// worth of traffic at `speed[i]`.
fn lockstep_rate(load: &[f64], speed: &[f64]) -> f64 {
    (load.iter().zip(speed))
        .filter(|(&l, _)| l > 1e-12)
        .map(|(&l, &s)| s / l)
        .fold(f64::INFINITY, f64::min)
}

/// The healthy state of the model: each NIC's speed, its comms, and their rate.
struct Healthy {
    speed: Vec<f64>,
    load: Vec<f64>,
    before: f64,
}

/// `None` when no NIC would survive or there are no comms.
fn healthy(speeds: &[u64], comms: u32) -> Option<Healthy> {
    if speeds.len() < 2 || comms == 0 {
        return None;
    }
    let speed: Vec<f64> = speeds.iter().map(|&s| s as f64).collect();
    let load = comms_per_nic(speeds.len(), comms);
    let before = lockstep_rate(&load, &speed);
    Some(Healthy {
        speed,
        load,
        before,
    })
}

fn comms_per_nic(nics: usize, comms: u32) -> Vec<f64> {
    let mut load = vec![0.0; nics];
    for c in 0..comms as usize {
        load[c % nics] += 1.0;
    }
    load
}

/// The capacity-optimal share kept: the failed NIC's comms split over the survivors in
/// whatever fractions maximise the common rate (water-filling, by bisection).
pub fn optimal_kept(speeds: &[u64], comms: u32) -> Option<f64> {
    let Healthy {
        speed,
        load,
        before,
    } = healthy(speeds, comms)?;
    let n = speed.len();
    let moved = load[0];
    // At rate r survivor j can take max(0, speed_j / r − load_j) more comms.
    let room = |r: f64| -> f64 { (1..n).map(|j| (speed[j] / r - load[j]).max(0.0)).sum() };
    // Survivors keep their own comms, which bound the rate; with none, no comm runs
    // faster than every NIC together.
    let kept_own = lockstep_rate(&load[1..], &speed[1..]);
    let (mut lo, mut hi) = (0.0f64, kept_own.min(speed.iter().sum::<f64>()));
    for _ in 0..200 {
        let mid = (lo + hi) / 2.0;
        if mid > 0.0 && room(mid) >= moved {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo / before)
}

/// What NCCL's native failover keeps: each comm of the failed NIC moves whole onto one
/// survivor (its fused partner); the best survivor is taken.
pub fn native_kept(speeds: &[u64], comms: u32) -> Option<f64> {
    let Healthy {
        speed,
        load,
        before,
    } = healthy(speeds, comms)?;
    (1..speed.len())
        .map(|j| {
            let mut after = load.clone();
            after[j] += after[0];
            after[0] = 0.0;
            lockstep_rate(&after, &speed) / before
        })
        .reduce(f64::max)
}

/// What the plugin's router keeps: every comm's stripes placed on the pairs it picks when
/// NIC 0 goes down, with survivors weighed by capacity (`weighted`) or counted equal.
pub fn router_kept(speeds: &[u64], comms: u32, weighted: bool) -> Option<f64> {
    let n = speeds.len();
    if n < 2 || comms == 0 {
        return None;
    }
    let stripes = 2 * (n - 1);
    let mut router = Router::new(RouterConfig {
        weighted,
        seed: 1,
        ..RouterConfig::default()
    });
    for (i, &s) in speeds.iter().enumerate() {
        router.set_link_speed(NicId(i as u32), s);
    }
    let now = Instant::now();
    let peer = PeerId(1);
    for c in 0..comms as usize {
        let nic = NicId((c % n) as u32);
        let spec = CommSpec {
            peer,
            local_nics: (0..n as u32)
                .map(|i| LocalNic {
                    id: NicId(i),
                    rail: Some(0),
                    distance: None,
                })
                .collect(),
            // Each rail runs at one speed at both ends, and the peer says so.
            remote_nics: (speeds.iter().enumerate())
                .map(|(i, &s)| RemoteNic {
                    id: NicId(i as u32),
                    rail: Some(0),
                    speed_mbps: Some(s),
                })
                .collect(),
            lanes: vec![(nic, nic); stripes],
        };
        router.add_comm(CommId(c), spec, now).ok()?;
        drive(&mut router, now);
    }
    let speed: Vec<f64> = speeds.iter().map(|&s| s as f64).collect();
    let load = |r: &Router| {
        let mut per: BTreeMap<u32, f64> = BTreeMap::new();
        for nic in r.snapshot().local_nics {
            per.insert(nic.nic.0, f64::from(nic.lanes) / stripes as f64);
        }
        (0..n as u32)
            .map(|i| per.get(&i).copied().unwrap_or(0.0))
            .collect::<Vec<f64>>()
    };
    let before = lockstep_rate(&load(&router), &speed);
    router.handle_nic_down(NicId(0), now);
    drive(&mut router, now);
    Some(lockstep_rate(&load(&router), &speed) / before)
}

/// Answers every probe good and takes every move, until the router is quiet.
fn drive(router: &mut Router, now: Instant) {
    loop {
        let mut busy = false;
        while router.poll_move().is_some() {
            busy = true;
        }
        while router.poll_event().is_some() {
            busy = true;
        }
        while let Some(p) = router.poll_probe() {
            busy = true;
            router.handle_probe(p.pair, true, now);
        }
        if !busy {
            return;
        }
    }
}

/// The rows for `speeds` at C = N and 2N, or at `comms` alone.
pub fn table(speeds: &[u64], comms: Option<u32>) -> Vec<WeightedRow> {
    let n = speeds.len() as u32;
    let counts = match comms {
        Some(c) => vec![c],
        None => vec![n, 2 * n],
    };
    counts
        .into_iter()
        .filter_map(|c| {
            Some(WeightedRow {
                speeds: speeds.to_vec(),
                comms: c,
                optimal: optimal_kept(speeds, c)?,
                weighted: router_kept(speeds, c, true)?,
                equal: router_kept(speeds, c, false)?,
                native: native_kept(speeds, c)?,
            })
        })
        .collect()
}

pub fn render(rows: &[WeightedRow]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "lockstep collective after NIC 0 fails, NICs at unequal rates: share of its rate kept\n\
         (C comms, comm c on NIC c mod N, each cut into 2(N-1) stripes placed by railover's\n\
         router; optimal: the largest equal per-comm rate the survivors can carry)\n"
    );
    let _ = writeln!(
        o,
        "{:<24} {:>4}  {:>8}  {:>17}  {:>13}  {:>11}",
        "Mbit/s per NIC", "C", "optimal", "capacity-weighted", "equal stripes", "NCCL native"
    );
    for r in rows {
        let speeds = (r.speeds.iter().map(u64::to_string))
            .collect::<Vec<_>>()
            .join(",");
        let _ = writeln!(
            o,
            "{:<24} {:>4}  {:>8.3}  {:>17.3}  {:>13.3}  {:>11.3}",
            speeds, r.comms, r.optimal, r.weighted, r.equal, r.native
        );
    }
    o
}

/// `--speeds`: Mbit/s per NIC (one value for clap, however many NICs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speeds(pub Vec<u64>);

/// Parses `--speeds`: Mbit/s per NIC, comma-separated, at least two, each above 0.
pub fn parse_speeds(v: &str) -> Result<Speeds, String> {
    let speeds: Option<Vec<u64>> = v
        .split(',')
        .map(|s| s.trim().parse::<u64>().ok().filter(|&x| x > 0))
        .collect();
    match speeds {
        Some(s) if (2..=64).contains(&s.len()) => Ok(Speeds(s)),
        _ => Err("expected 2 to 64 comma-separated rates in Mbit/s, each above 0".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-6, "{a} != {b}");
    }

    #[test]
    fn the_example_of_two_fast_and_two_slow_nics() {
        // 200/200/100/100, 2 comms each: the 100s pace at 50; all of the failed NIC's
        // comms fit on the other 200 (1.0); equal thirds overload the 100s (0.75).
        let s = [200, 200, 100, 100];
        close(optimal_kept(&s, 8).unwrap(), 1.0);
        close(router_kept(&s, 8, true).unwrap(), 1.0);
        close(router_kept(&s, 8, false).unwrap(), 0.75);
        close(native_kept(&s, 8).unwrap(), 1.0);
        close(router_kept(&s, 4, true).unwrap(), 1.0);
        close(router_kept(&s, 4, false).unwrap(), 0.75);
    }

    #[test]
    fn equal_nics_keep_n_minus_one_over_n_either_way() {
        for n in [2usize, 4, 8] {
            let s = vec![400; n];
            let ideal = (n as f64 - 1.0) / n as f64;
            close(optimal_kept(&s, n as u32).unwrap(), ideal);
            close(router_kept(&s, n as u32, true).unwrap(), ideal);
            close(router_kept(&s, n as u32, false).unwrap(), ideal);
            close(native_kept(&s, n as u32).unwrap(), 0.5);
        }
    }

    #[test]
    fn weighted_placement_reaches_the_optimum_where_stripes_can() {
        // 200/150/150/100 one comm each: halves of the failed comm on the 150s keep 1.0.
        let s = [200, 150, 150, 100];
        close(optimal_kept(&s, 4).unwrap(), 1.0);
        close(router_kept(&s, 4, true).unwrap(), 1.0);
        close(router_kept(&s, 4, false).unwrap(), 0.75);
        // And never above the optimum, never below equal striping, on a few mixes.
        for s in [
            vec![400, 400, 200, 100],
            vec![100, 400, 400, 400],
            vec![400, 100, 100, 100],
            vec![200, 200, 200, 200, 100, 100, 100, 100],
        ] {
            for c in [s.len() as u32, 2 * s.len() as u32] {
                let opt = optimal_kept(&s, c).unwrap();
                let w = router_kept(&s, c, true).unwrap();
                let e = router_kept(&s, c, false).unwrap();
                assert!(w <= opt + 1e-9, "{s:?} C={c}: {w} > optimum {opt}");
                assert!(w + 1e-9 >= e, "{s:?} C={c}: weighted {w} < equal {e}");
                assert!(
                    w >= 0.9 * opt,
                    "{s:?} C={c}: weighted {w} < 0.9 x optimum {opt}"
                );
            }
        }
    }

    #[test]
    fn speeds_parse_or_say_what_is_accepted() {
        assert_eq!(
            parse_speeds("200,200,100,100"),
            Ok(Speeds(vec![200, 200, 100, 100]))
        );
        for bad in ["200", "200,0", "200,x", ""] {
            assert!(parse_speeds(bad).unwrap_err().contains("Mbit/s"), "{bad}");
        }
    }
}
