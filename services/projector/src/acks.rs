//! Cumulative acks of the job log: one ack for many folded events.
//!
//! The `projector` consumer acks all (`ack_policy: all`): an ack of event `n` acks every
//! event up to `n`. This module owns when that is safe: an ack covers only a prefix of
//! the log this projector has folded itself, contiguous from the consumer's ack floor.
//! An event above the floor that it has not folded (still in a lane, handed back with a
//! nak, or held by another client of the consumer) stops the prefix there; the event
//! comes back (a nak's delay, the ack wait) and the prefix moves on once it is folded.
//! So whatever other clients do, no event is acked unfolded; with one puller (the
//! [`crate::lease`]) the acks keep up.
//!
//! A hole in the prefix that lasts [`HOLE_CHECK`] is looked into: the consumer's own
//! floor may have moved past it (another projector acked it), or the event was deleted
//! from the log (it is never delivered); either way the prefix goes past it.
//!
//! One ack goes out every [`ACK_EVERY`] at most, instead of one per event.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, stream::DirectGetErrorKind};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

/// Longest a folded prefix waits for its ack.
pub const ACK_EVERY: Duration = Duration::from_millis(20);

/// How long a hole in the prefix lasts before it is looked into.
pub const HOLE_CHECK: Duration = Duration::from_secs(1);

/// Longest the acks go on after the pull stopped, while the lanes fold what came.
pub const DRAIN: Duration = Duration::from_secs(30);

/// The acks of one subscription generation of the `projector` consumer (a recreated
/// consumer starts a new one: [`Acks::received`] takes the generation).
#[derive(Clone)]
pub(crate) struct Acks {
    state: Arc<Mutex<State<jetstream::Message>>>,
}

/// What the acks know, with `T` the message an ack is sent with.
struct State<T> {
    /// The subscription generation this state is of.
    generation: u64,
    /// Every event at or below it is acked on the server; `None` until read.
    floor: Option<u64>,
    /// The delivery sequence of the last ack: the server ignores an ack of an earlier
    /// delivery, so each ack must be of a later one than the last.
    floor_delivery: u64,
    /// Events above the floor received by this projector: their latest delivery, and
    /// once that delivery is folded, the message to ack with.
    held: BTreeMap<u64, (u64, Option<T>)>,
    /// Since when the prefix has stopped at a hole.
    hole_since: Option<Instant>,
}

impl<T> State<T> {
    fn new(generation: u64) -> State<T> {
        State { generation, floor: None, floor_delivery: 0, held: BTreeMap::new(), hole_since: None }
    }

    /// Delivery `delivery` of event `seq` reached this projector: until it is folded, the
    /// prefix stops there.
    fn received(&mut self, seq: u64, delivery: u64) {
        if self.floor.is_some_and(|f| seq <= f) {
            return;
        }
        let e = self.held.entry(seq).or_insert((delivery, None));
        if delivery > e.0 {
            *e = (delivery, None);
        }
    }

    /// Delivery `delivery` of event `seq` is folded; `ack` acks the log up to it.
    fn folded(&mut self, seq: u64, delivery: u64, ack: T) {
        if self.floor.is_some_and(|f| seq <= f) {
            return;
        }
        let e = self.held.entry(seq).or_insert((delivery, None));
        // An earlier delivery folded late: the latest one is folded too, and acked with.
        if delivery >= e.0 {
            *e = (delivery, Some(ack));
        }
    }

    /// The ack to send now, if any, with the floor moved to it: the latest event of the
    /// folded prefix (contiguous from the floor) whose delivery is later than the last
    /// ack's and earlier than that of every event held above it (an ack of a later
    /// delivery would leave those unackable until they came again).
    fn next_ack(&mut self) -> Option<T> {
        let floor = self.floor?;
        let mut end = floor;
        let mut stopped_at = None;
        for (seq, (_, ack)) in &self.held {
            if *seq != end + 1 || ack.is_none() {
                stopped_at = Some(*seq);
                break;
            }
            end = *seq;
        }
        // A hole: the event after the prefix is not here at all.
        let hole = stopped_at.is_some_and(|s| s > end + 1);
        match (hole, self.hole_since) {
            (true, None) => self.hole_since = Some(Instant::now()),
            (false, _) => self.hole_since = None,
            _ => {}
        }
        let mut earliest_above = u64::MAX;
        let mut chosen = None;
        for (seq, (delivery, _)) in self.held.iter().rev() {
            if *seq <= end && *delivery > self.floor_delivery && *delivery < earliest_above {
                chosen = Some((*seq, *delivery));
                break;
            }
            earliest_above = earliest_above.min(*delivery);
        }
        let (seq, delivery) = chosen?;
        let rest = self.held.split_off(&(seq + 1));
        let (_, ack) = std::mem::replace(&mut self.held, rest).remove(&seq).expect("chosen from held");
        self.floor = Some(seq);
        self.floor_delivery = delivery;
        ack
    }

    /// The server's floor is `seq`, acked with delivery `delivery`: what is at or below
    /// it is acked.
    fn raise_floor(&mut self, seq: u64, delivery: u64) {
        self.floor_delivery = self.floor_delivery.max(delivery);
        if self.floor.is_some_and(|f| f >= seq) {
            return;
        }
        self.floor = Some(seq);
        self.held = self.held.split_off(&(seq + 1));
        self.hole_since = None;
    }
}

/// A message's event (stream sequence) and delivery (consumer sequence).
fn seqs_of(msg: &jetstream::Message) -> Option<(u64, u64)> {
    msg.info().ok().map(|i| (i.stream_sequence, i.consumer_sequence))
}

impl Acks {
    /// The acks of `consumer`, sent on `tracker` until `stop` and then for as long as
    /// events received before it are being folded (at most [`DRAIN`]); `log` is the
    /// stream it reads, for the holes.
    pub(crate) fn start(
        consumer: PullConsumer,
        log: jetstream::stream::Stream<()>,
        stop: CancellationToken,
        tracker: &TaskTracker,
    ) -> Acks {
        let acks = Acks { state: Arc::new(Mutex::new(State::new(0))) };
        tracker.spawn(acks.clone().send(consumer, log, stop));
        acks
    }

    /// `msg` of subscription `generation` reached this projector.
    pub(crate) fn received(&self, msg: &jetstream::Message, generation: u64) {
        let Some((seq, delivery)) = seqs_of(msg) else { return };
        let mut s = self.state.lock().expect("acks lock");
        if generation > s.generation {
            // A new subscription: the consumer may be a new one (a rebuild), with a floor
            // of its own; nothing of the old one is acked on it.
            *s = State::new(generation);
        }
        if s.generation == generation {
            s.received(seq, delivery);
        }
    }

    /// `msg` of subscription `generation` is folded: it may be acked with the prefix.
    pub(crate) fn folded(&self, msg: jetstream::Message, generation: u64) {
        let Some((seq, delivery)) = seqs_of(&msg) else { return };
        let mut s = self.state.lock().expect("acks lock");
        if s.generation == generation {
            s.folded(seq, delivery, msg);
        }
    }

    async fn send(self, mut consumer: PullConsumer, log: jetstream::stream::Stream<()>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(ACK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stopped: Option<Instant> = None;
        loop {
            if stopped.is_none() {
                tokio::select! {
                    _ = stop.cancelled() => stopped = Some(Instant::now()),
                    _ = tick.tick() => {}
                }
            } else {
                tick.tick().await;
            }
            let (unsent, needs_floor, hole) = {
                let mut s = self.state.lock().expect("acks lock");
                let unsent = s.next_ack();
                let hole = s.hole_since.is_some_and(|t| t.elapsed() >= HOLE_CHECK);
                (unsent, s.floor.is_none(), hole)
            };
            if let Some(msg) = unsent {
                if let Err(e) = msg.ack().await {
                    warn!(error = %e, "cumulative ack not sent; the next one covers it");
                }
            }
            if let Some(at) = stopped {
                // Every delivery holds a handle: once the lanes let go of them, the last
                // prefix is acked.
                if Arc::strong_count(&self.state) == 1 || at.elapsed() >= DRAIN {
                    let last = self.state.lock().expect("acks lock").next_ack();
                    if let Some(msg) = last {
                        let _ = msg.ack().await;
                    }
                    return;
                }
                continue;
            }
            if needs_floor || hole {
                let generation = self.state.lock().expect("acks lock").generation;
                self.look(&mut consumer, &log, generation).await;
            }
        }
    }

    /// Reads the consumer's floor (at the start, or at a hole), and past a hole that
    /// stays, whether its event was deleted from the log.
    async fn look(&self, consumer: &mut PullConsumer, log: &jetstream::stream::Stream<()>, generation: u64) {
        let info = match consumer.info().await {
            Ok(i) => i.clone(),
            Err(e) => {
                warn!(error = %e, "cannot read the projector consumer's ack floor; retrying");
                return;
            }
        };
        let next = {
            let mut s = self.state.lock().expect("acks lock");
            if s.generation != generation {
                return;
            }
            s.raise_floor(info.ack_floor.stream_sequence, info.ack_floor.consumer_sequence);
            match (s.floor, s.hole_since) {
                (Some(f), Some(since)) if since.elapsed() >= HOLE_CHECK => Some(f + 1),
                _ => None,
            }
        };
        // Still a hole: an event delivered but not here (another client has it: it comes
        // back after the ack wait), or one deleted from the log (it never comes).
        let Some(seq) = next.filter(|seq| *seq <= info.delivered.stream_sequence) else { return };
        match log.direct_get(seq).await {
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => {
                debug!(seq, "event deleted from the log: the acks go past it");
                let mut s = self.state.lock().expect("acks lock");
                if s.generation == generation && s.floor == Some(seq - 1) {
                    s.floor = Some(seq);
                }
            }
            Ok(_) => {
                let mut s = self.state.lock().expect("acks lock");
                // Looked into again after another HOLE_CHECK.
                s.hole_since = Some(Instant::now());
            }
            Err(e) => warn!(seq, error = %e, "cannot read the log at a hole in the acks; retrying"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Floor `floor`, events `(seq, delivery)` received and not folded; an ack is the
    /// event's sequence.
    fn state(floor: u64, held: &[(u64, u64)]) -> State<u64> {
        let mut s = State::new(1);
        s.floor = Some(floor);
        s.floor_delivery = floor;
        held.iter().for_each(|(seq, d)| s.received(*seq, *d));
        s
    }

    #[test]
    fn one_ack_covers_the_folded_prefix_and_stops_at_the_first_event_not_folded() {
        let mut s = state(10, &[(11, 11), (12, 12), (13, 13)]);
        s.folded(12, 12, 12);
        assert_eq!(s.next_ack(), None, "11 is not folded: nothing past it");
        s.folded(11, 11, 11);
        assert_eq!(s.next_ack(), Some(12), "one ack for 11 and 12");
        assert_eq!(s.next_ack(), None);
        s.folded(13, 13, 13);
        assert_eq!(s.next_ack(), Some(13));
        assert!(s.held.is_empty() && s.hole_since.is_none());
    }

    #[test]
    fn an_event_at_or_below_the_floor_changes_nothing() {
        let mut s = state(10, &[(11, 11)]);
        s.received(9, 20);
        s.folded(10, 21, 10);
        assert_eq!(s.next_ack(), None);
        assert_eq!(s.held.keys().copied().collect::<Vec<_>>(), vec![11]);
    }

    #[test]
    fn a_hole_holds_the_acks_until_its_event_comes_back_or_the_server_floor_passes_it() {
        // 11 went to another client; 12 and 13 are here and folded.
        let mut s = state(10, &[(12, 11), (13, 12)]);
        s.folded(12, 11, 12);
        s.folded(13, 12, 13);
        assert_eq!(s.next_ack(), None, "never past 11, which nobody here folded");
        assert!(s.hole_since.is_some(), "11 is missing");
        // It comes back (a later delivery, after the ack wait) and is folded here: the
        // ack goes with 13, whose delivery is earlier than 11's second.
        s.received(11, 40);
        s.folded(11, 40, 11);
        assert_eq!(s.next_ack(), Some(13));
        assert!(s.hole_since.is_none());

        // Or the server's floor moved past 11 (another projector folded and acked it).
        let mut s = state(10, &[(12, 11), (13, 12)]);
        s.folded(12, 11, 12);
        s.raise_floor(11, 10);
        assert_eq!(s.next_ack(), Some(12));
        // A floor read that is behind ours changes nothing.
        s.raise_floor(5, 3);
        assert_eq!(s.floor, Some(12));
        assert_eq!(s.held.keys().copied().collect::<Vec<_>>(), vec![13]);
    }

    #[test]
    fn no_ack_of_a_later_delivery_strands_the_events_above_it() {
        // 12 came back (delivery 50) while 13 and 14 are folded from their first
        // deliveries (13, 14); 15 is not folded yet.
        let mut s = state(11, &[(13, 13), (14, 14), (15, 15)]);
        s.received(12, 50);
        s.folded(13, 13, 13);
        s.folded(14, 14, 14);
        s.folded(12, 50, 12);
        // Acking 14 with delivery 14 would be refused (12's delivery 50 is folded below
        // it, but the ack is of 14's delivery): the ack goes with 14, delivery 14, which
        // is later than the floor's 11 and earlier than 15's.
        assert_eq!(s.next_ack(), Some(14));
        assert_eq!(s.floor_delivery, 14);
        s.folded(15, 15, 15);
        assert_eq!(s.next_ack(), Some(15), "15 still ackable");

        // Had 12 been the end of the prefix, its delivery (50) would make 13's (13)
        // unackable: it waits instead.
        let mut s = state(11, &[(13, 13)]);
        s.received(12, 50);
        s.folded(12, 50, 12);
        assert_eq!(s.next_ack(), None, "acking delivery 50 would strand 13 (delivery 13)");
        s.folded(13, 13, 13);
        assert_eq!(s.next_ack(), Some(13));
    }

    #[test]
    fn a_redelivery_of_a_folded_event_is_folded_again_before_it_is_acked_with() {
        let mut s = state(10, &[(11, 11)]);
        s.folded(11, 11, 11);
        s.received(11, 30);
        assert_eq!(s.next_ack(), None, "delivery 30 is in a lane");
        // The first delivery's fold arriving late changes nothing.
        s.folded(11, 11, 11);
        assert_eq!(s.next_ack(), None);
        s.folded(11, 30, 11);
        assert_eq!(s.next_ack(), Some(11));
        assert_eq!(s.floor_delivery, 30);
    }

    #[test]
    fn nothing_moves_before_the_floor_is_read() {
        let mut s: State<u64> = State::new(1);
        s.received(5, 1);
        s.folded(5, 1, 5);
        assert_eq!(s.next_ack(), None);
        s.raise_floor(4, 0);
        assert_eq!(s.next_ack(), Some(5));
    }
}
