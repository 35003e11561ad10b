//! Receive buffers the peer offered to have written in place, as a placing lane keeps
//! them: the offer a `Place` frame carries, and which one a message may use.
//!
//! Fabric-neutral so that the simulation's lanes choose exactly as verbs lanes do: what
//! decides whether a message (sent again or not) goes in place, in the stream, or waits,
//! lives here, not in one fabric.

use std::collections::BTreeMap;

use crate::config::ZeroCopy;
use crate::conn::wire::{Header, Kind, PLACE_BODY};

/// Payloads at least this large are written in place when the receiver offers its buffer
/// (`RAILOVER_ZERO_COPY=auto`): below it the ring's copy costs less than a second work
/// request and a registration.
pub const PLACE_MIN: u64 = 4096;

/// Offers a lane keeps at most (the receiver has at most a few hundred receives open;
/// the oldest go first).
pub const MAX_OFFERS: usize = 4096;

/// A receive buffer the peer offered to have written in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    pub addr: u64,
    pub rkey: u32,
    pub capacity: u64,
    /// The lanes the receiver had fenced when it made the offer.
    pub gen: u64,
}

impl Offer {
    /// The `Place` frame offering receive `seq`.
    pub fn frame(self, seq: u64) -> Vec<u8> {
        let mut h = Header::new(Kind::Place, seq, self.capacity);
        h.aux = self.rkey;
        let mut f = h.encode().to_vec();
        f.extend_from_slice(&self.addr.to_le_bytes());
        f.extend_from_slice(&self.gen.to_le_bytes());
        f
    }

    /// The offer a `Place` frame makes, `None` if its body is not an address and a
    /// generation.
    pub fn of_frame(h: &Header, body: &[u8]) -> Option<Offer> {
        let body: &[u8; PLACE_BODY as usize] = body.try_into().ok()?;
        let (addr, gen) = body.split_at(8);
        Some(Offer {
            addr: u64::from_le_bytes(addr.try_into().ok()?),
            rkey: h.aux,
            capacity: h.len,
            gen: u64::from_le_bytes(gen.try_into().ok()?),
        })
    }
}

/// The least payload written in place under `zero_copy`, and whether a message waits for
/// an offer rather than go in the stream, for a message that `must` go in place (GPU
/// memory); `None`: nothing goes in place.
pub fn policy(zero_copy: ZeroCopy, must: bool) -> Option<(u64, bool)> {
    match zero_copy {
        _ if must => Some((1, true)),
        ZeroCopy::Off => None,
        ZeroCopy::Auto => Some((PLACE_MIN, false)),
        ZeroCopy::Always => Some((1, true)),
    }
}

/// What a message does with a lane's offers ([`Offers::pick`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Written in place into this offer (still held: remove it once posted).
    Place(Offer),
    /// Sent in the stream.
    Stream,
    /// Waits for an offer (it must go in place).
    Wait,
}

/// The offers one lane holds, by receive sequence number.
#[derive(Debug, Default)]
pub struct Offers(BTreeMap<u64, Offer>);

impl Offers {
    /// The peer offered receive `seq` (a `Place` frame); the oldest goes past the bound.
    pub fn insert(&mut self, seq: u64, offer: Offer) {
        if self.0.len() >= MAX_OFFERS {
            self.0.pop_first();
        }
        self.0.insert(seq, offer);
    }

    /// The offer message `seq` may use: one made no earlier than generation `min_gen`
    /// (the receiver had fenced every lane the message could have been lost with). Offers
    /// for older receives are dropped first: first transmissions go out in order, so
    /// theirs went to other lanes, and a message sent again follows a `Fence` after which
    /// the receiver offers it afresh.
    pub fn fresh(&mut self, seq: u64, min_gen: u64) -> Option<Offer> {
        while self.0.first_key_value().is_some_and(|(&s, _)| s < seq) {
            self.0.pop_first();
        }
        self.0.get(&seq).filter(|o| o.gen >= min_gen).copied()
    }

    /// What message `seq` of `len` bytes does, under the [`policy`] `(least, wait)` and
    /// sent as `min_gen` allows ([`Offers::fresh`]): no fresh offer yet means the stream,
    /// or waiting; an offer it does not fit (below `least`, above the buffer) is dropped
    /// and the message goes in the stream.
    pub fn pick(&mut self, seq: u64, len: u64, min_gen: u64, (least, wait): (u64, bool)) -> Pick {
        let Some(offer) = self.fresh(seq, min_gen) else {
            return if wait { Pick::Wait } else { Pick::Stream };
        };
        if len < least || len > offer.capacity {
            self.remove(seq);
            return Pick::Stream;
        }
        Pick::Place(offer)
    }

    /// The offer for `seq` is used up (or of no use).
    pub fn remove(&mut self, seq: u64) {
        self.0.remove(&seq);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(gen: u64) -> Offer {
        Offer {
            addr: 0x1000,
            rkey: 7,
            capacity: 4096,
            gen,
        }
    }

    #[test]
    fn a_place_frame_carries_the_offer() {
        let o = Offer {
            addr: 0xdead_beef_0000,
            rkey: 42,
            capacity: 1 << 20,
            gen: 3,
        };
        let f = o.frame(9);
        let h = Header::decode(&f[..crate::conn::wire::HEADER_LEN]).unwrap();
        assert_eq!((h.kind, h.seq), (Kind::Place, 9));
        assert_eq!(
            Offer::of_frame(&h, &f[crate::conn::wire::HEADER_LEN..]),
            Some(o)
        );
        assert_eq!(Offer::of_frame(&h, &[0; 3]), None, "a short body");
    }

    #[test]
    fn a_resent_message_needs_an_offer_made_after_the_fence() {
        let mut offers = Offers::default();
        offers.insert(5, offer(0));
        assert_eq!(offers.fresh(5, 1), None, "made before the receiver fenced");
        assert_eq!(offers.fresh(5, 0), Some(offer(0)), "a first transmission");
        offers.insert(5, offer(1));
        assert_eq!(offers.fresh(5, 1), Some(offer(1)));
    }

    #[test]
    fn older_offers_go_and_the_bound_holds() {
        let mut offers = Offers::default();
        for seq in 0..4 {
            offers.insert(seq, offer(0));
        }
        assert_eq!(offers.fresh(2, 0), Some(offer(0)));
        assert_eq!(offers.len(), 2, "0 and 1 went to other lanes");
        offers.remove(2);
        assert_eq!(offers.fresh(2, 0), None);
        let mut many = Offers::default();
        for seq in 0..MAX_OFFERS as u64 + 5 {
            many.insert(seq, offer(0));
        }
        assert_eq!(many.len(), MAX_OFFERS);
        assert_eq!(many.fresh(0, 0), None, "the oldest went first");
    }

    #[test]
    fn a_message_is_placed_streamed_or_kept_waiting_as_the_policy_says() {
        let auto = policy(ZeroCopy::Auto, false).unwrap();
        assert_eq!(policy(ZeroCopy::Off, false), None);
        assert_eq!(policy(ZeroCopy::Off, true), Some((1, true)), "GPU memory");
        let mut offers = Offers::default();
        assert_eq!(offers.pick(1, 8192, 0, auto), Pick::Stream, "no offer yet");
        assert_eq!(offers.pick(1, 8192, 0, (1, true)), Pick::Wait);
        offers.insert(1, offer(0));
        assert_eq!(offers.pick(1, 4096, 0, auto), Pick::Place(offer(0)));
        assert_eq!(offers.pick(1, 4096, 1, auto), Pick::Stream, "a stale offer");
        assert_eq!(offers.len(), 1, "kept for a first transmission");
        assert_eq!(
            offers.pick(1, 100, 0, auto),
            Pick::Stream,
            "below PLACE_MIN"
        );
        assert_eq!(offers.len(), 0, "an offer it does not fit goes");
        offers.insert(2, offer(0));
        assert_eq!(
            offers.pick(2, 4097, 0, (1, true)),
            Pick::Stream,
            "too large"
        );
        assert!(offers.is_empty());
    }
}
