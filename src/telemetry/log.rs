//! `tracing` events, delivered to NCCL's logger when NCCL gave one at `init`, else to
//! stderr. WARN goes to NCCL's WARN (kept as NCCL's "last error"); INFO goes to INFO with
//! the `NCCL_NET` subsystem, so `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=NET` shows it.

use std::fmt::Write as _;
use std::sync::Once;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

use crate::config::LogLevel;
use crate::ffi::logger::{self, Severity};

/// Installs the bridge as this library's global subscriber, once. The library carries
/// its own copy of `tracing`, so this never replaces a subscriber of the host program.
pub fn install(stderr_level: LogLevel) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // INFO is always produced: NCCL's logger filters by NCCL_DEBUG itself.
        let max = match stderr_level {
            LogLevel::Debug => LevelFilter::DEBUG,
            LogLevel::Trace => LevelFilter::TRACE,
            _ => LevelFilter::INFO,
        };
        let layer = Bridge {
            stderr: stderr_level,
        }
        .with_filter(max);
        let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer));
    });
}

struct Bridge {
    stderr: LogLevel,
}

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
        if logger::emit(severity, file, line, &msg.0) {
            return;
        }
        let wanted = match level {
            Level::ERROR | Level::WARN => LogLevel::Warn,
            Level::INFO => LogLevel::Info,
            Level::DEBUG => LogLevel::Debug,
            _ => LogLevel::Trace,
        };
        if wanted <= self.stderr {
            // Wall-clock milliseconds, so lines from two processes line up.
            let ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            eprintln!("railover {level} {ms}: {}", msg.0);
        }
    }
}
