//! Frame encode/decode (`conn::wire`): the 24-byte header every message and control frame
//! carries, and the handshake's Hello with a four-NIC list.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use criterion::{criterion_group, criterion_main, Criterion};
use railover::conn::wire::{Header, Hello, Kind, NicAddr, Purpose, HEADER_LEN};

fn frames(c: &mut Criterion) {
    let h = Header::new(Kind::Data, 42, 1 << 20);
    c.bench_function("wire/header_encode", |b| b.iter(|| black_box(&h).encode()));
    let bytes = h.encode();
    c.bench_function("wire/header_decode", |b| {
        b.iter(|| Header::decode(black_box(&bytes)).expect("valid header"))
    });
    let hello = Hello {
        purpose: Purpose::Data,
        comm: [0; 16],
        nonce: [7; 32],
        eph: [9; 32],
        epoch: 0,
        nics: (0..4)
            .map(|i| NicAddr {
                addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 77, i, 1)), 40_000),
                rail: Some(i as u32),
                mbps: Some(400_000),
            })
            .collect(),
    };
    c.bench_function("wire/hello_encode_4_nics", |b| {
        b.iter(|| black_box(&hello).encode())
    });
    let frame = hello.encode();
    c.bench_function("wire/hello_decode_4_nics", |b| {
        b.iter(|| Hello::decode(black_box(&frame[HEADER_LEN..])).expect("valid hello"))
    });
}

criterion_group!(benches, frames);
criterion_main!(benches);
