//! `tracing` events, delivered to NCCL's logger when NCCL gave one at `init`, else to
//! stderr. WARN goes to NCCL's WARN (kept as NCCL's "last error"); INFO goes to INFO with
//! the `NCCL_NET` subsystem, so `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=NET` shows it.
//!
//! NCCL's logger is a C function, so `ffi` owns the call to it and hands this module a
//! plain function to reach it ([`set_nccl_sink`]): telemetry imports nothing above it.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Once, OnceLock};

use parking_lot::Mutex;

use tracing::field::{Field, Visit};
use tracing::metadata::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

use crate::config::LogLevel;

/// How a line should appear in NCCL's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Warn,
    Info,
    Trace,
}

/// Sends one line to NCCL's logger; `false` when NCCL gave none.
pub type NcclSink = fn(Severity, &str, u32, &str) -> bool;

static SINK: OnceLock<NcclSink> = OnceLock::new();

/// Test seam: while capturing, lines meant for NCCL's logger are kept here instead.
/// Rust tests cannot define the C-variadic function NCCL's logger is.
static CAPTURING: AtomicBool = AtomicBool::new(false);
static CAPTURED: Mutex<Vec<(Severity, String)>> = Mutex::new(Vec::new());

/// Called by `ffi` at `init`: the way to NCCL's logger (the same for every `init`).
pub fn set_nccl_sink(sink: NcclSink) {
    let _ = SINK.set(sink);
}

/// Test only: from now on, keep every line meant for NCCL's logger for [`captured`].
#[doc(hidden)]
pub fn capture() {
    CAPTURED.lock().clear();
    CAPTURING.store(true, Ordering::Release);
}

/// Test only: the lines kept since [`capture`], in order.
#[doc(hidden)]
pub fn captured() -> Vec<(Severity, String)> {
    CAPTURED.lock().clone()
}

/// One line for NCCL's logger; `false` when there is none to take it.
fn to_nccl(sev: Severity, file: &str, line: u32, msg: &str) -> bool {
    if CAPTURING.load(Ordering::Acquire) {
        CAPTURED.lock().push((sev, msg.to_string()));
        return true;
    }
    SINK.get().is_some_and(|sink| sink(sev, file, line, msg))
}

/// The stderr level (`RAILOVER_LOG`), as `LogLevel as u8`. Warn until the configuration is
/// read, so a bad value of any variable is still reported.
static STDERR_LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Warn as u8);

/// Installs the bridge as this library's global subscriber, once. The library carries
/// its own copy of `tracing`, so this never replaces a subscriber of the host program.
/// Called before the configuration is parsed, so that its errors reach NCCL's log.
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ =
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Bridge));
    });
}

/// Sets the stderr level once `RAILOVER_LOG` is known. DEBUG and TRACE events are only
/// produced while it asks for them (NCCL's logger never gets them otherwise).
pub fn set_stderr_level(level: LogLevel) {
    if STDERR_LEVEL.swap(level as u8, Ordering::AcqRel) != level as u8 {
        // Callsites cache whether they are enabled; make them ask again.
        tracing::callsite::rebuild_interest_cache();
    }
}

fn stderr_level() -> LogLevel {
    match STDERR_LEVEL.load(Ordering::Acquire) {
        0 => LogLevel::Off,
        1 => LogLevel::Warn,
        2 => LogLevel::Info,
        3 => LogLevel::Debug,
        _ => LogLevel::Trace,
    }
}

/// The most detailed level produced: INFO always (NCCL's logger filters by NCCL_DEBUG
/// itself), DEBUG or TRACE when `RAILOVER_LOG` asks for them.
fn max_level() -> LevelFilter {
    match stderr_level() {
        LogLevel::Debug => LevelFilter::DEBUG,
        LogLevel::Trace => LevelFilter::TRACE,
        _ => LevelFilter::INFO,
    }
}

struct Bridge;

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

impl<S: Subscriber> Layer<S> for Bridge {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if max_level() >= *meta.level() {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        max_level() >= *meta.level()
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(max_level())
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut msg = Message(String::new());
        event.record(&mut msg);
        let meta = event.metadata();
        let level = *meta.level();
        let severity = match level {
            Level::ERROR | Level::WARN => Severity::Warn,
            Level::INFO => Severity::Info,
            _ => Severity::Trace,
        };
        let file = meta.file().unwrap_or("railover");
        let line = meta.line().unwrap_or(0);
        if to_nccl(severity, file, line, &msg.0) {
            return;
        }
        let wanted = match level {
            Level::ERROR | Level::WARN => LogLevel::Warn,
            Level::INFO => LogLevel::Info,
            Level::DEBUG => LogLevel::Debug,
            _ => LogLevel::Trace,
        };
        if wanted <= stderr_level() {
            // Wall-clock milliseconds, so lines from two processes line up.
            let ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            eprintln!("railover {level} {ms}: {}", msg.0);
        }
    }
}
