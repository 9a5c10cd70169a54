//! Fuzz target: the credits ledger's fold (`Account::apply_message`), as every reader
//! of an account runs it over whatever is stored on the owner's subjects.
//!
//! An input is a sequence of ledger messages of the owner `alice`, separated by a blank
//! line: the first line of each is the subject it was stored on, the rest its payload.
//! Properties: never panics, never hangs; an entry that does not fit changes nothing;
//! after every message the account holds together (what is reserved is the sum of the
//! open reservations, the balance is granted less charged, no total is negative but the
//! balance); and the entries that fitted fold again, on their own, into the same account.
//! Corpus: `tests/corpus/ledger/`. See `services/core/tests/fuzz_harness/mod.rs` for the
//! knobs.

#[path = "../../core/tests/fuzz_harness/mod.rs"]
mod fuzz_harness;

use std::path::Path;

use fuzz_harness::{fuzz, Target};
use stemq_accounts::ledger::{fold, Account};

const OWNER: &str = "alice";

const DICTIONARY: &[&[u8]] = &[
    b"stemq.ledger.alice.granted\n",
    b"stemq.ledger.alice.reserved\n",
    b"stemq.ledger.alice.released\n",
    b"stemq.ledger.alice.settled\n",
    b"stemq.ledger.alice.refunded\n",
    b"stemq.ledger.alice\n",
    b"stemq.ledger.bob.granted\n",
    b"\n\n",
    b"\"owner\":\"alice\"",
    b"\"owner\":\"bob\"",
    b"\"kind\":\"granted\"",
    b"\"kind\":\"reserved\"",
    b"\"kind\":\"released\"",
    b"\"kind\":\"settled\"",
    b"\"kind\":\"refunded\"",
    b"\"amount\"",
    b"\"charged\"",
    b"\"reserved\"",
    b"\"per_minute\"",
    b"\"audio_ms\"",
    b"\"job_id\"",
    b"\"model\":\"htdemucs\"",
    b"\"after\"",
    b"9223372036854775807",
    b"-9223372036854775808",
    b"18446744073709551615",
    b"-1",
    b"0",
    b"1e300",
    b"null",
];

fn holds_together(a: &Account, what: &str) {
    let open: i128 = a.open.values().map(|o| o.amount as i128).sum();
    assert_eq!(open, a.reserved as i128, "{what}: reserved is not the open reservations: {a:?}");
    assert!(a.open.values().all(|o| o.amount >= 0 && o.per_minute >= 0), "{what}: {a:?}");
    assert!(a.reserved >= 0 && a.charged >= 0 && a.refunded >= 0, "{what}: a negative total: {a:?}");
    assert_eq!(a.balance as i128, a.granted as i128 - a.charged as i128, "{what}: balance: {a:?}");
}

#[test]
fn fuzz_ledger() {
    let target = Target {
        name: "ledger",
        corpus: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/ledger"),
        dictionary: DICTIONARY,
        max_len: 16 * 1024,
    };
    fuzz(target, |input| {
        let mut account = Account::default();
        let mut fitted = Vec::new();
        let mut records = Vec::new();
        let mut start = 0;
        while start <= input.len() {
            let end = input[start..].windows(2).position(|w| w == b"\n\n").map_or(input.len(), |p| start + p);
            records.push(&input[start..end]);
            start = end + 2;
        }
        for record in records {
            let (subject, payload) = match record.iter().position(|b| *b == b'\n') {
                Some(i) => (&record[..i], &record[i + 1..]),
                None => (record, &[][..]),
            };
            let subject = String::from_utf8_lossy(subject);
            let before = account.clone();
            match account.apply_message(OWNER, &subject, payload) {
                Ok(entry) => fitted.push(entry),
                Err(why) => assert_eq!(account, before, "a misfit ({why}) changed the account"),
            }
            holds_together(&account, &subject);
        }
        assert_eq!(fold(&fitted), account, "the fitted entries fold into another account");
        !fitted.is_empty()
    });
}
