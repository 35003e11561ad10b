//! The failover time series as an SVG chart (`railover bench --failover --plot`): each of
//! node A's NICs and the slowest comm over time, the cut and the restore marked.
//!
//! plotters' SVG backend writes text as `<text>` elements for the viewer to render, so
//! no font library is linked (the crate is built without its font features).

use std::path::Path;

use plotters::prelude::*;

use crate::failover_bench::{Report, NATIVE};

const SIZE: (u32, u32) = (960, 540);
/// One colour per NIC (Tableau 10), distinct on white.
const NIC_COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

pub fn failover_svg(path: &Path, r: &Report) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    // The last tick before the sender stops is cut short by the drain: left out.
    let t_end = (r.timeline.end_s - 0.25).max(1.0);
    let rate = r.rate_mbit as f64;
    let mode = match r.lockstep {
        Some(k) => format!("lockstep K={k}"),
        None => "free-running".into(),
    };
    let caption = format!(
        "{} rails x {} Mbit/s, {} comms, {mode}: slowest comm kept {:.2} (ideal {:.2}, NCCL native {NATIVE:.2})",
        r.rails, r.rate_mbit, r.comms, r.kept.slowest, r.ideal
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..t_end, 0.0..rate * 1.25)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("Mbit/s")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|x| e(&x))?;

    for (i, name) in r.series.devs.iter().enumerate() {
        let color = NIC_COLOURS[i % NIC_COLOURS.len()];
        let pts = r
            .series
            .dev_mbit
            .iter()
            .filter(|p| p.t <= t_end)
            .filter_map(|p| Some((p.t, *p.mbit.get(i)?)));
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(1)))
            .map_err(|x| e(&x))?
            .label(format!("{name} sent (node A)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
    }
    let slowest = r
        .series
        .comms
        .iter()
        .filter(|p| p.t <= t_end)
        .map(|p| (p.t, p.slowest));
    chart
        .draw_series(LineSeries::new(slowest, BLACK.stroke_width(3)))
        .map_err(|x| e(&x))?
        .label("slowest comm (node B, 1 s)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.stroke_width(3)));

    let grey = RGBColor(90, 90, 90);
    let marks = [
        (r.timeline.cut_s, "rv0 cut on node A"),
        (r.timeline.up_s, "rv0 restored"),
    ];
    for (t, label) in marks {
        let color = grey;
        chart
            .draw_series(LineSeries::new(
                [(t, 0.0), (t, rate * 1.2)],
                color.stroke_width(1),
            ))
            .map_err(|x| e(&x))?;
        chart
            .draw_series(std::iter::once(Text::new(
                label.to_string(),
                (t + 0.2, rate * 1.2),
                ("sans-serif", 14).into_font().color(&color),
            )))
            .map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
