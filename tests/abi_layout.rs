//! The Rust mirror of NCCL's plugin structs must be laid out exactly as a C compiler lays
//! out NCCL's own declarations, for every version we export (v8 … v12): a single wrong
//! offset makes NCCL read garbage out of our properties or call the wrong slot of our
//! function table.
//!
//! `tests/abi/layout.c` declares the structs as NCCL's headers do (`tests/abi/nccl_net.h`)
//! and prints `sizeof`, `alignof`, every member's `offsetof` and `sizeof`. This test
//! compiles and runs it, then checks three sources against each other:
//! the C compiler, `size_of`/`align_of`/`offset_of!` of `railover::ffi::types`, and the
//! numbers written below, as gcc lays out NCCL's own headers on x86_64
//! (`plugins/net/example/nccl/net_v8.h` … `net_v12.h` at NCCL 2.30.7; `docs/design.md`
//! §8.1).

#[path = "abi/support.rs"]
mod support;

use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of};
use std::process::Command;
use std::sync::OnceLock;

use railover::ffi::types::{
    CommAttr, CommConfig, NetAttr, NetDeviceHandle, NetV10, NetV11, NetV12, NetV8, NetV9,
    PropertiesV11, PropertiesV12, PropertiesV8, PropertiesV9, VDevicePropsV11, VDevicePropsV12,
};

/// `(C type, None)` → (size, align) of the struct; `(C type, Some(member))` → (offset, size).
type Layout = BTreeMap<(String, Option<String>), (usize, usize)>;

/// Size of a struct member's type, named through a projection closure (no `unsafe`, no value).
fn member_size<T, F>(_project: impl Fn(&T) -> &F) -> usize {
    size_of::<F>()
}

/// Records the layout of a Rust type under the name of the C type it mirrors.
/// `cMember => rust_field` pairs name every member of the C struct.
macro_rules! mirror {
    ($layout:ident, $c_type:literal, $ty:ty, { $($c_member:ident => $field:ident),* $(,)? }) => {
        $layout.insert(($c_type.to_owned(), None), (size_of::<$ty>(), align_of::<$ty>()));
        $(
            $layout.insert(
                ($c_type.to_owned(), Some(stringify!($c_member).to_owned())),
                (offset_of!($ty, $field), member_size(|s: &$ty| &s.$field)),
            );
        )*
    };
}

macro_rules! device_handle {
    ($layout:ident, $c_type:literal) => {
        mirror!($layout, $c_type, NetDeviceHandle, {
            netDeviceType => net_device_type,
            netDeviceVersion => net_device_version,
            handle => handle,
            size => size,
            needsProxyProgress => needs_proxy_progress,
        });
    };
}

macro_rules! v_props {
    ($layout:ident, $c_type:literal, $ty:ty) => {
        mirror!($layout, $c_type, $ty, { ndevs => ndevs, devs => devs });
    };
}

macro_rules! net_attr {
    ($layout:ident, $attr:literal, $comm_attr:literal, $config:literal) => {
        mirror!($layout, $config, CommConfig, { trafficClass => traffic_class });
        mirror!($layout, $comm_attr, CommAttr, {
            maxConcurrentPeers => max_concurrent_peers,
            minConcurrentPeers => min_concurrent_peers,
            maxFlowsPerPeer => max_flows_per_peer,
            minFlowsPerPeer => min_flows_per_peer,
        });
        mirror!($layout, $attr, NetAttr, {
            sendCommAttr => send_comm_attr,
            recvCommAttr => recv_comm_attr,
            op => op,
            algo => algo,
            proto => proto,
        });
    };
}

/// Properties members from v9 on (v9 and v10 are the same struct).
macro_rules! properties_v9 {
    ($layout:ident, $c_type:literal, $ty:ty, { $($extra:ident => $field:ident),* $(,)? }) => {
        mirror!($layout, $c_type, $ty, {
            name => name,
            pciPath => pci_path,
            guid => guid,
            ptrSupport => ptr_support,
            regIsGlobal => reg_is_global,
            forceFlush => force_flush,
            speed => speed,
            port => port,
            latency => latency,
            maxComms => max_comms,
            maxRecvs => max_recvs,
            netDeviceType => net_device_type,
            netDeviceVersion => net_device_version,
            vProps => v_props,
            maxP2pBytes => max_p2p_bytes,
            maxCollBytes => max_coll_bytes,
            $($extra => $field,)*
        });
    };
}

/// Function-table members every version from v8 on has, plus the given extras.
macro_rules! table {
    ($layout:ident, $c_type:literal, $ty:ty, { $($extra:ident => $field:ident),* $(,)? }) => {
        mirror!($layout, $c_type, $ty, {
            name => name,
            init => init,
            devices => devices,
            getProperties => get_properties,
            listen => listen,
            connect => connect,
            accept => accept,
            regMr => reg_mr,
            regMrDmaBuf => reg_mr_dma_buf,
            deregMr => dereg_mr,
            isend => isend,
            irecv => irecv,
            iflush => iflush,
            test => test,
            closeSend => close_send,
            closeRecv => close_recv,
            closeListen => close_listen,
            getDeviceMr => get_device_mr,
            irecvConsumed => irecv_consumed,
            $($extra => $field,)*
        });
    };
}

fn rust_layout() -> Layout {
    let mut l = Layout::new();
    device_handle!(l, "ncclNetDeviceHandle_v8_t");
    device_handle!(l, "ncclNetDeviceHandle_v9_t");
    device_handle!(l, "ncclNetDeviceHandle_v10_t");
    device_handle!(l, "ncclNetDeviceHandle_v11_t");
    device_handle!(l, "ncclNetDeviceHandle_v12_t");

    v_props!(l, "ncclNetVDeviceProps_v9_t", VDevicePropsV11);
    v_props!(l, "ncclNetVDeviceProps_v10_t", VDevicePropsV11);
    v_props!(l, "ncclNetVDeviceProps_v11_t", VDevicePropsV11);
    v_props!(l, "ncclNetVDeviceProps_v12_t", VDevicePropsV12);

    mirror!(l, "ncclNetCommConfig_v10_t", CommConfig, { trafficClass => traffic_class });
    net_attr!(
        l,
        "ncclNetAttr_v11_t",
        "ncclNetCommAttr_v11_t",
        "ncclNetCommConfig_v11_t"
    );
    net_attr!(
        l,
        "ncclNetAttr_v12_t",
        "ncclNetCommAttr_v12_t",
        "ncclNetCommConfig_v12_t"
    );

    mirror!(l, "ncclNetProperties_v8_t", PropertiesV8, {
        name => name,
        pciPath => pci_path,
        guid => guid,
        ptrSupport => ptr_support,
        regIsGlobal => reg_is_global,
        speed => speed,
        port => port,
        latency => latency,
        maxComms => max_comms,
        maxRecvs => max_recvs,
        netDeviceType => net_device_type,
        netDeviceVersion => net_device_version,
    });
    properties_v9!(l, "ncclNetProperties_v9_t", PropertiesV9, {});
    properties_v9!(l, "ncclNetProperties_v10_t", PropertiesV9, {});
    properties_v9!(l, "ncclNetProperties_v11_t", PropertiesV11, {
        maxMultiRequestSize => max_multi_request_size,
    });
    properties_v9!(l, "ncclNetProperties_v12_t", PropertiesV12, {
        maxMultiRequestSize => max_multi_request_size,
        railId => rail_id,
        planeId => plane_id,
    });

    table!(l, "ncclNet_v8_t", NetV8, {});
    table!(l, "ncclNet_v9_t", NetV9, { makeVDevice => make_v_device });
    table!(l, "ncclNet_v10_t", NetV10, { makeVDevice => make_v_device });
    table!(l, "ncclNet_v11_t", NetV11, {
        makeVDevice => make_v_device,
        finalize => finalize,
        setNetAttr => set_net_attr,
    });
    table!(l, "ncclNet_v12_t", NetV12, {
        makeVDevice => make_v_device,
        finalize => finalize,
        setNetAttr => set_net_attr,
    });
    l
}

/// Expected struct sizes and member offsets of NCCL's headers on x86_64 (`docs/design.md`
/// §8.1): helper structs, properties structs and function tables.
/// `(C type, None)` → sizeof; `(C type, Some(member))` → offsetof.
fn reference_layout() -> BTreeMap<(String, Option<String>), usize> {
    let mut r = BTreeMap::new();
    let mut put = |ty: &str, member: Option<&str>, value: usize| {
        r.insert((ty.to_owned(), member.map(str::to_owned)), value);
    };

    for v in 8..=12 {
        let ty = format!("ncclNetDeviceHandle_v{v}_t");
        put(&ty, None, 32);
        for (m, off) in [
            ("netDeviceType", 0),
            ("netDeviceVersion", 4),
            ("handle", 8),
            ("size", 16),
            ("needsProxyProgress", 24),
        ] {
            put(&ty, Some(m), off);
        }
    }
    for (v, size) in [(9, 20), (10, 20), (11, 20), (12, 36)] {
        let ty = format!("ncclNetVDeviceProps_v{v}_t");
        put(&ty, None, size);
        put(&ty, Some("ndevs"), 0);
        put(&ty, Some("devs"), 4);
    }
    for v in 10..=12 {
        let ty = format!("ncclNetCommConfig_v{v}_t");
        put(&ty, None, 4);
        put(&ty, Some("trafficClass"), 0);
    }
    for v in 11..=12 {
        let ty = format!("ncclNetCommAttr_v{v}_t");
        put(&ty, None, 16);
        for (i, m) in [
            "maxConcurrentPeers",
            "minConcurrentPeers",
            "maxFlowsPerPeer",
            "minFlowsPerPeer",
        ]
        .into_iter()
        .enumerate()
        {
            put(&ty, Some(m), 4 * i);
        }
        let ty = format!("ncclNetAttr_v{v}_t");
        put(&ty, None, 44);
        for (m, off) in [
            ("sendCommAttr", 0),
            ("recvCommAttr", 16),
            ("op", 32),
            ("algo", 36),
            ("proto", 40),
        ] {
            put(&ty, Some(m), off);
        }
    }

    // Properties structs: offsets per version v8, v9, v10, v11, v12 (None = member absent).
    #[rustfmt::skip]
    let props: [(&str, [Option<usize>; 5]); 19] = [
        ("name",                [Some(0),  Some(0),   Some(0),   Some(0),   Some(0)]),
        ("pciPath",             [Some(8),  Some(8),   Some(8),   Some(8),   Some(8)]),
        ("guid",                [Some(16), Some(16),  Some(16),  Some(16),  Some(16)]),
        ("ptrSupport",          [Some(24), Some(24),  Some(24),  Some(24),  Some(24)]),
        ("regIsGlobal",         [Some(28), Some(28),  Some(28),  Some(28),  Some(28)]),
        ("forceFlush",          [None,     Some(32),  Some(32),  Some(32),  Some(32)]),
        ("speed",               [Some(32), Some(36),  Some(36),  Some(36),  Some(36)]),
        ("port",                [Some(36), Some(40),  Some(40),  Some(40),  Some(40)]),
        ("latency",             [Some(40), Some(44),  Some(44),  Some(44),  Some(44)]),
        ("maxComms",            [Some(44), Some(48),  Some(48),  Some(48),  Some(48)]),
        ("maxRecvs",            [Some(48), Some(52),  Some(52),  Some(52),  Some(52)]),
        ("netDeviceType",       [Some(52), Some(56),  Some(56),  Some(56),  Some(56)]),
        ("netDeviceVersion",    [Some(56), Some(60),  Some(60),  Some(60),  Some(60)]),
        ("vProps",              [None,     Some(64),  Some(64),  Some(64),  Some(64)]),
        ("maxP2pBytes",         [None,     Some(88),  Some(88),  Some(88),  Some(104)]),
        ("maxCollBytes",        [None,     Some(96),  Some(96),  Some(96),  Some(112)]),
        ("maxMultiRequestSize", [None,     None,      None,      Some(104), Some(120)]),
        ("railId",              [None,     None,      None,      None,      Some(124)]),
        ("planeId",             [None,     None,      None,      None,      Some(126)]),
    ];
    for (i, (v, size)) in [(8, 64), (9, 104), (10, 104), (11, 112), (12, 128)]
        .into_iter()
        .enumerate()
    {
        let ty = format!("ncclNetProperties_v{v}_t");
        put(&ty, None, size);
        for (m, offsets) in &props {
            if let Some(off) = offsets[i] {
                put(&ty, Some(m), off);
            }
        }
    }

    // Function tables: every slot is one pointer, in this order.
    const SLOTS: [&str; 22] = [
        "name",
        "init",
        "devices",
        "getProperties",
        "listen",
        "connect",
        "accept",
        "regMr",
        "regMrDmaBuf",
        "deregMr",
        "isend",
        "irecv",
        "iflush",
        "test",
        "closeSend",
        "closeRecv",
        "closeListen",
        "getDeviceMr",
        "irecvConsumed",
        "makeVDevice",
        "finalize",
        "setNetAttr",
    ];
    for (v, slots, size) in [
        (8, 19, 152),
        (9, 20, 160),
        (10, 20, 160),
        (11, 22, 176),
        (12, 22, 176),
    ] {
        let ty = format!("ncclNet_v{v}_t");
        put(&ty, None, size);
        for (i, m) in SLOTS[..slots].iter().enumerate() {
            put(&ty, Some(m), 8 * i);
        }
    }
    r
}

/// The C compiler's layout, computed once per test process.
fn c_layout() -> &'static Layout {
    static C_LAYOUT: OnceLock<Layout> = OnceLock::new();
    C_LAYOUT.get_or_init(compile_and_run_layout_c)
}

fn compile_and_run_layout_c() -> Layout {
    let exe = support::compile_c(
        "layout.c",
        "layout",
        &["-std=c11", "-O1", "-Wall", "-Wextra", "-Wpedantic"],
        &[],
    );
    let out = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
    assert!(
        out.status.success(),
        "{} failed: {}",
        exe.display(),
        out.status
    );
    let text = String::from_utf8(out.stdout).expect("layout output is ASCII");
    let mut l = Layout::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |s: &str| -> usize {
            s.parse()
                .unwrap_or_else(|_| panic!("bad number in `{line}`"))
        };
        let (key, value) = match words.as_slice() {
            ["struct", ty, size, align] => ((ty.to_string(), None), (num(size), num(align))),
            ["field", ty, member, off, size] => (
                (ty.to_string(), Some(member.to_string())),
                (num(off), num(size)),
            ),
            _ => panic!("unexpected line from layout.c: `{line}`"),
        };
        assert!(l.insert(key, value).is_none(), "duplicate line `{line}`");
    }
    assert!(!l.is_empty(), "layout.c printed nothing");
    l
}

fn describe(key: &(String, Option<String>)) -> String {
    match &key.1 {
        None => key.0.clone(),
        Some(m) => format!("{}.{m}", key.0),
    }
}

#[test]
fn rust_types_match_the_c_compiler() {
    let c = c_layout();
    let rust = rust_layout();
    let mut errors = Vec::new();
    for (key, &(c_a, c_b)) in c {
        let what = if key.1.is_none() {
            ("sizeof", "alignof")
        } else {
            ("offsetof", "sizeof")
        };
        match rust.get(key) {
            None => errors.push(format!("{}: not checked on the Rust side", describe(key))),
            Some(&(r_a, r_b)) => {
                if r_a != c_a {
                    errors.push(format!(
                        "{}: {} is {c_a} in C but {r_a} in Rust",
                        describe(key),
                        what.0
                    ));
                }
                if r_b != c_b {
                    errors.push(format!(
                        "{}: {} is {c_b} in C but {r_b} in Rust",
                        describe(key),
                        what.1
                    ));
                }
            }
        }
    }
    for key in rust.keys().filter(|k| !c.contains_key(*k)) {
        errors.push(format!("{}: missing from layout.c", describe(key)));
    }
    println!("compared {} C records with the Rust mirror", c.len());
    assert!(
        errors.is_empty(),
        "layout mismatches:\n{}",
        errors.join("\n")
    );
}

#[test]
fn c_declarations_match_the_reference() {
    let c = c_layout();
    let reference = reference_layout();
    let mut errors = Vec::new();
    for (key, &expected) in &reference {
        match c.get(key) {
            None => errors.push(format!("{}: not declared in nccl_net.h", describe(key))),
            Some(&(actual, _)) if actual != expected => errors.push(format!(
                "{}: reference says {expected}, C compiler says {actual}",
                describe(key)
            )),
            Some(_) => {}
        }
    }
    for key in c.keys().filter(|k| !reference.contains_key(*k)) {
        errors.push(format!("{}: not in the reference table", describe(key)));
    }
    assert!(errors.is_empty(), "C vs reference:\n{}", errors.join("\n"));
}

#[test]
fn rust_types_match_the_reference() {
    let rust = rust_layout();
    let reference = reference_layout();
    let mut errors = Vec::new();
    for (key, &expected) in &reference {
        match rust.get(key) {
            None => errors.push(format!("{}: no Rust counterpart", describe(key))),
            Some(&(actual, _)) if actual != expected => errors.push(format!(
                "{}: reference says {expected}, Rust says {actual}",
                describe(key)
            )),
            Some(_) => {}
        }
    }
    assert!(
        errors.is_empty(),
        "Rust vs reference:\n{}",
        errors.join("\n")
    );
}

/// The numbers a wrong mirror most often gets wrong, spelled out so a failure reads plainly.
#[test]
fn key_sizes() {
    assert_eq!(size_of::<PropertiesV8>(), 64);
    assert_eq!(size_of::<PropertiesV9>(), 104);
    assert_eq!(size_of::<PropertiesV11>(), 112);
    assert_eq!(size_of::<PropertiesV12>(), 128);
    assert_eq!(offset_of!(PropertiesV12, max_p2p_bytes), 104);
    assert_eq!(offset_of!(PropertiesV12, rail_id), 124);
    assert_eq!(offset_of!(PropertiesV12, plane_id), 126);
    assert_eq!(size_of::<NetV8>(), 152);
    assert_eq!(size_of::<NetV9>(), 160);
    assert_eq!(size_of::<NetV10>(), 160);
    assert_eq!(size_of::<NetV11>(), 176);
    assert_eq!(size_of::<NetV12>(), 176);
    assert_eq!(size_of::<NetDeviceHandle>(), 32);
    assert_eq!(size_of::<NetAttr>(), 44);
}
