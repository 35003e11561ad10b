//! `railover demo`: a live failover. As root on a namespace testbed; otherwise on
//! loopback with the cut injected inside the plugin (see `failover_demo`).

pub fn run(args: &[String]) -> i32 {
    let mut seconds = 15.0f64;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match (a.as_str(), it.clone().next()) {
            ("--seconds", Some(v)) => {
                seconds = match v.parse::<f64>() {
                    Ok(s) if s > 0.0 && s <= 3600.0 => s,
                    _ => {
                        eprintln!("railover demo: --seconds {v:?} is not valid: expected a number of seconds in (0, 3600]");
                        return 2;
                    }
                };
                it.next();
            }
            _ => {
                eprintln!("railover demo: unknown option {a:?} (accepted: --seconds N)");
                return 2;
            }
        }
    }
    match railover::testbed::unavailable() {
        None => {
            crate::failover_demo::run(seconds.max(12.0), crate::failover_demo::Mode::Namespaces)
        }
        Some(why) => {
            println!("railover demo: LOOPBACK VARIANT with in-process fault injection ({why})");
            crate::failover_demo::run(seconds.max(12.0), crate::failover_demo::Mode::Loopback)
        }
    }
}
