use super::*;

fn config(kind: Kind) -> Config {
    Config {
        kind,
        start: 10,
        end: Some(20),
        hold: Some(5),
        interval: 10,
        interval_hold: 4,
        cooldown: 0,
    }
}

fn at(counter: u64) -> Observation {
    Observation {
        counter,
        ..Observation::default()
    }
}

fn with_lr(counter: u64, lr: f64) -> Observation {
    Observation {
        counter,
        lr: Some(lr),
        ..Observation::default()
    }
}

fn with_loss(counter: u64, loss: f64) -> Observation {
    Observation {
        counter,
        loss: Some(loss),
        ..Observation::default()
    }
}

fn with_scale(counter: u64, scale: f64) -> Observation {
    Observation {
        counter,
        scale: Some(scale),
        ..Observation::default()
    }
}

#[test]
fn policy_numbers() {
    assert_eq!(Kind::from_number(0).unwrap(), Kind::Time);
    assert_eq!(Kind::from_number(1).unwrap(), Kind::TimeLr);
    assert_eq!(Kind::from_number(2).unwrap().number(), 2);
    assert!(matches!(
        Kind::from_number(3),
        Err(Error::InvalidArgument(_))
    ));
    assert!(Kind::from_number(-1).is_err());
}

#[test]
fn config_validation() {
    let mut c = config(Kind::Time);
    c.end = Some(10);
    assert!(AmpPolicy::new(c.clone()).is_err());
    c.end = Some(11);
    assert!(AmpPolicy::new(c).is_ok());

    let mut c = config(Kind::TimeLr);
    c.hold = None;
    let err = AmpPolicy::new(c.clone()).unwrap_err().to_string();
    assert!(err.contains("hold_time"), "{err}");
    c.hold = Some(0);
    assert!(AmpPolicy::new(c).is_err());

    let mut c = config(Kind::Loss);
    c.end = Some(0); // not used by policy 2
    c.interval_hold = 10;
    assert!(AmpPolicy::new(c.clone()).is_err());
    c.interval_hold = 0;
    assert!(AmpPolicy::new(c.clone()).is_err());
    c.interval_hold = 9;
    assert!(AmpPolicy::new(c.clone()).is_ok());
    c.interval = 0;
    assert!(AmpPolicy::new(c).is_err());
}

#[test]
fn amp_time_window_bounds() {
    let mut p = AmpPolicy::new(config(Kind::Time)).unwrap();
    let got: Vec<bool> = [0, 9, 10, 11, 19, 20, 21].map(|c| p.decide(at(c))).to_vec();
    assert_eq!(got, [false, false, true, true, true, false, false]);
    assert_eq!(p.last_reason(), Reason::AfterEnd);

    let mut c = config(Kind::Time);
    c.end = None;
    let mut p = AmpPolicy::new(c).unwrap();
    assert!(!p.decide(at(9)));
    assert_eq!(p.last_reason(), Reason::BeforeStart);
    assert!(p.decide(at(10)));
    assert!(p.decide(at(u64::MAX)));
    assert_eq!(p.last_reason(), Reason::InWindow);
}

#[test]
fn amp_lr_change_holds() {
    let mut c = config(Kind::TimeLr);
    c.start = 0;
    c.end = None;
    let mut p = AmpPolicy::new(c).unwrap();
    assert!(p.decide(with_lr(0, 1.0))); // first lr: reference, no event
    assert!(p.decide(with_lr(1, 0.91))); // 9 % change: below the tolerance
    assert!(!p.decide(with_lr(3, 0.89))); // 11 %: event, hold [3, 8)
    assert_eq!(p.last_reason(), Reason::Hold);
    assert!(!p.decide(with_lr(7, 0.89)));
    assert!(p.decide(with_lr(8, 0.89)));
    // The reference moved to 0.89: 0.85 is within 10 % of it.
    assert!(p.decide(with_lr(9, 0.85)));
    // No lr at all: no event.
    assert!(p.decide(at(10)));
}

#[test]
fn amp_hold_extends_and_window_still_applies() {
    let mut p = AmpPolicy::new(config(Kind::TimeLr)).unwrap();
    assert!(!p.decide(with_lr(0, 1.0)));
    assert!(!p.decide(with_lr(9, 0.1))); // hold [9, 14), before start anyway
    assert!(!p.decide(with_lr(10, 0.1)));
    assert!(!p.decide(with_lr(12, 0.01))); // extends to [12, 17)
    assert!(!p.decide(with_lr(16, 0.01)));
    assert!(p.decide(with_lr(17, 0.01)));
    assert!(!p.decide(with_lr(20, 0.01))); // end of the window
    assert_eq!(p.last_reason(), Reason::AfterEnd);
}

#[test]
fn amp_loss_spike_holds() {
    let mut c = config(Kind::TimeLr);
    c.start = 0;
    c.end = None;
    // Four samples are not enough to judge.
    let mut p = AmpPolicy::new(c.clone()).unwrap();
    for i in 0..4 {
        assert!(p.decide(with_loss(i, 1.0)));
    }
    assert!(p.decide(with_loss(4, 10.0)));

    // Constant losses: std 0, so the 2 % floor decides.
    let mut p = AmpPolicy::new(c.clone()).unwrap();
    for i in 0..5 {
        assert!(p.decide(with_loss(i, 1.0)));
    }
    let (mut q, mut r) = (p.clone(), p.clone());
    assert!(p.decide(with_loss(5, 1.019)));
    assert!(!q.decide(with_loss(5, 1.021))); // hold [5, 10)
    assert_eq!(q.last_reason(), Reason::Hold);
    assert!(!q.decide(at(9)));
    assert!(q.decide(at(10)));
    // The same spike below the mean.
    assert!(!r.decide(with_loss(5, 0.979)));

    // Noisy losses: 4 standard deviations.
    let mut p = AmpPolicy::new(c).unwrap();
    for i in 0..20u64 {
        let loss = if i % 2 == 0 { 1.1 } else { 0.9 }; // mean 1, std 0.1
        assert!(p.decide(with_loss(i, loss)));
    }
    let mut q = p.clone();
    assert!(p.decide(with_loss(20, 1.39)));
    assert!(!q.decide(with_loss(20, 1.41)));
}

#[test]
fn amp_nonfinite_losses_are_not_samples() {
    let mut c = config(Kind::TimeLr);
    c.start = 0;
    c.end = None;
    let mut p = AmpPolicy::new(c).unwrap();
    for i in 0..4 {
        p.decide(with_loss(i, 1.0));
    }
    p.decide(with_loss(4, f64::NAN)); // guard off (cooldown 0): no effect
    assert!(p.decide(with_loss(5, 5.0)), "only 4 finite samples before");
    assert_eq!(p.state().losses.len(), 5);
}

fn feed_window(p: &mut AmpPolicy, base: u64, losses: [f64; 4]) -> Vec<bool> {
    let mut out = vec![p.decide(with_loss(base, 100.0))]; // excluded point
    for (i, l) in losses.iter().enumerate() {
        out.push(p.decide(with_loss(base + 1 + i as u64, *l)));
    }
    out
}

fn linear(s: f64) -> [f64; 4] {
    [1.0 - s, 1.0 - 2.0 * s, 1.0 - 3.0 * s, 1.0 - 4.0 * s]
}

#[test]
fn amp_trend_windows_and_verdicts() {
    let c = config(Kind::Loss);
    let mut p = AmpPolicy::new(c.clone()).unwrap();
    assert!(p.decide(at(0)));
    assert!(p.decide(at(9)));
    assert_eq!(p.last_reason(), Reason::TrendDefault);
    // Window [10, 14): trial; the verdict comes at 14 from losses at 11..=14.
    let got = feed_window(&mut p, 10, linear(0.2)); // r = 0.8 / 0.5 = 1.6
    assert_eq!(got, [true, true, true, true, false]);
    assert_eq!(p.last_reason(), Reason::TrendFast);
    assert!(!p.decide(at(19)));
    assert!(p.decide(at(20)));
    assert_eq!(p.last_reason(), Reason::Trial);

    // Thresholds: r = 4s / (1 - 2.5s).
    for (s, expect) in [
        (0.094, Reason::TrendOk),    // r = 0.4915
        (0.097, Reason::TrendFast),  // r = 0.512
        (0.0026, Reason::TrendOk),   // r = 0.01047
        (0.0024, Reason::TrendSlow), // r = 0.00966
        (-0.01, Reason::TrendSlow),  // rising
    ] {
        let mut p = AmpPolicy::new(c.clone()).unwrap();
        feed_window(&mut p, 10, linear(s));
        assert_eq!(p.last_reason(), expect, "s = {s}");
        assert_eq!(p.decide(at(15)), expect == Reason::TrendOk);
    }
}

#[test]
fn amp_trend_needs_three_points_and_keeps_verdict() {
    let mut p = AmpPolicy::new(config(Kind::Loss)).unwrap();
    feed_window(&mut p, 10, linear(0.0)); // slow
    assert_eq!(p.last_reason(), Reason::TrendSlow);
    // Window [20, 24) with two points only: the verdict stays.
    assert!(p.decide(at(20)));
    assert!(p.decide(with_loss(21, 1.0)));
    assert!(p.decide(with_loss(22, 0.5)));
    assert!(!p.decide(at(24)));
    assert_eq!(p.last_reason(), Reason::TrendSlow);
    // Jumping past a window still closes it.
    assert!(p.decide(at(30)));
    for (i, l) in linear(0.05).iter().take(3).enumerate() {
        assert!(p.decide(with_loss(31 + i as u64, *l)));
    }
    assert!(p.decide(at(55))); // three points, r = 0.15 / 0.9

    assert_eq!(p.last_reason(), Reason::TrendOk);
}

fn guarded(cooldown: u64) -> AmpPolicy {
    let mut c = config(Kind::Time);
    c.start = 0;
    c.end = None;
    c.cooldown = cooldown;
    AmpPolicy::new(c).unwrap()
}

#[test]
fn amp_guard_nonfinite_loss_cooldown_bounds() {
    let mut p = guarded(10);
    assert!(p.decide(with_loss(4, 1.0)));
    assert!(!p.decide(with_loss(5, f64::INFINITY)));
    assert_eq!(p.last_trip(), Some(Trip::NonFiniteLoss));
    assert!(!p.decide(at(14)));
    assert_eq!(p.last_reason(), Reason::Cooldown);
    assert!(p.decide(at(15)));
    assert!(!p.cooling());
    // Disabled guard.
    let mut p = guarded(0);
    assert!(p.decide(with_loss(5, f64::NAN)));
}

#[test]
fn amp_guard_scale_floor_and_collapse() {
    let mut p = guarded(10);
    assert!(p.decide(with_scale(0, 1.0)));
    assert!(!p.decide(with_scale(1, 0.5)));
    assert_eq!(p.last_trip(), Some(Trip::ScaleFloor));

    let mut p = guarded(10);
    assert!(p.decide(with_scale(0, 65536.0)));
    let mut q = p.clone();
    assert!(p.decide(with_scale(1, 65.0))); // 1008x below the peak
    assert!(!q.decide(with_scale(1, 64.0))); // 1024x
    assert_eq!(q.last_trip(), Some(Trip::ScaleCollapse));

    let mut p = guarded(10);
    assert!(!p.decide(with_scale(0, f64::NAN)));
    assert_eq!(p.last_trip(), Some(Trip::NonFiniteScale));
}

#[test]
fn amp_guard_repeated_overflow() {
    let mut p = guarded(10);
    let mut scale = 65536.0;
    assert!(p.decide(with_scale(0, scale)));
    // Five decreases among growing steps: no trip.
    for c in 1..=5 {
        scale /= 2.0;
        assert!(p.decide(with_scale(c, scale)));
        assert!(p.decide(with_scale(c, scale)));
    }
    scale /= 2.0;
    assert!(!p.decide(with_scale(6, scale)), "sixth decrease trips");
    assert_eq!(p.last_trip(), Some(Trip::Overflow));

    // Decreases older than 32 calls are forgotten.
    let mut p = guarded(10);
    let mut scale = 65536.0;
    p.decide(with_scale(0, scale));
    for _ in 0..5 {
        scale /= 2.0;
        p.decide(with_scale(1, scale));
    }
    for _ in 0..27 {
        p.decide(with_scale(1, scale));
    }
    scale /= 2.0;
    assert!(p.decide(with_scale(1, scale)), "first decrease fell out");
}

#[test]
fn amp_guard_backoff() {
    let mut p = guarded(10);
    let nan = |c| with_loss(c, f64::NAN);
    assert!(!p.decide(nan(0))); // [0, 10)
    assert!(p.decide(at(10)));
    assert!(!p.decide(nan(12))); // within 10 of the end: [12, 32)
    assert!(!p.decide(at(31)));
    assert!(p.decide(at(32)));
    assert!(!p.decide(nan(51))); // within 20 of 32: [51, 91)
    assert!(!p.decide(at(90)));
    assert!(p.decide(at(91)));
    assert_eq!(p.state().cool_level, 2);
    assert!(!p.decide(nan(131))); // 40 after the end: back to [131, 141)
    assert!(p.decide(at(141)));
    assert_eq!(p.state().cool_level, 0);
    assert_eq!(p.state().trips, 4);
    // The level stops at 4.
    let mut c = 141;
    for _ in 0..6 {
        p.decide(nan(c));
        c = p.state().cool_until.unwrap();
    }
    assert_eq!(p.state().cool_level, MAX_BACKOFF);
}

#[test]
fn amp_guard_ignores_trips_while_cooling_then_rearms() {
    let mut p = guarded(10);
    assert!(!p.decide(with_loss(0, f64::NAN)));
    assert!(!p.decide(with_scale(5, 0.5))); // during the cool-down: no new trip
    assert_eq!(p.state().trips, 1);
    assert!(p.decide(with_scale(10, 2.0))); // re-armed at 10, scale fine
    assert_eq!(p.state().peak_scale, Some(2.0));
}

#[test]
fn amp_counter_backwards_resets() {
    let mut p = AmpPolicy::new(config(Kind::Loss)).unwrap();
    feed_window(&mut p, 10, linear(0.0));
    assert!(!p.decide(at(15)));
    assert!(p.decide(at(3)));
    assert_eq!(p.last_reason(), Reason::TrendDefault);
    assert_eq!(p.state().resets, 1);
    // Repeating a counter is not going backwards.
    assert!(p.decide(at(3)));
    assert_eq!(p.state().resets, 1);
}

fn scripted(i: u64) -> Observation {
    let wobble = ((i * 7919) % 13) as f64 / 100.0;
    let loss = if i == 37 {
        f64::NAN
    } else {
        2.0 / (1.0 + i as f64 / 10.0) + wobble
    };
    let scale = 65536.0 / (1u64 << ((i / 9) % 7)) as f64;
    Observation {
        counter: i,
        lr: Some(if i < 60 { 0.1 } else { 0.01 }),
        loss: Some(loss),
        scale: Some(scale),
    }
}

#[test]
fn amp_state_roundtrip_decides_identically() {
    for kind in [Kind::Time, Kind::TimeLr, Kind::Loss] {
        let mut c = config(kind);
        c.end = Some(150);
        c.cooldown = 7;
        let mut whole = AmpPolicy::new(c.clone()).unwrap();
        let expected: Vec<bool> = (0..200).map(|i| whole.decide(scripted(i))).collect();
        assert!(expected.iter().any(|d| *d) && expected.iter().any(|d| !*d));
        for cut in [1, 13, 37, 64, 111] {
            let mut first = AmpPolicy::new(c.clone()).unwrap();
            let mut got: Vec<bool> = (0..cut).map(|i| first.decide(scripted(i))).collect();
            let mut second = AmpPolicy::from_state(c.clone(), first.state()).unwrap();
            got.extend((cut..200).map(|i| second.decide(scripted(i))));
            assert_eq!(got, expected, "{kind:?} cut at {cut}");
            assert_eq!(second.state(), whole.state());
        }
    }
}

#[test]
fn amp_state_validation() {
    let c = config(Kind::Time);
    let s = State {
        losses: vec![f64::NAN],
        ..State::default()
    };
    assert!(AmpPolicy::from_state(c.clone(), s).is_err());
    let s = State {
        cool_level: 9,
        ..State::default()
    };
    assert!(AmpPolicy::from_state(c.clone(), s).is_err());
    let s = State {
        overflows: vec![false; 33],
        ..State::default()
    };
    assert!(AmpPolicy::from_state(c, s).is_err());
}
