// Checks test_page.py runs inside the page (execute_async_script: each function's
// last argument is selenium's callback).
const checks = {
  // WCAG contrast of an element's text against the page's white output box
  contrast(selector, done) {
    const rgb = (s) => s.match(/[\d.]+/g).slice(0, 3).map(Number);
    const lin = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4); };
    const lum = ([r, g, b]) => 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
    const el = document.querySelector(selector);
    let bg = el, back = "rgba(0, 0, 0, 0)";
    while (bg && (back = getComputedStyle(bg).backgroundColor) === "rgba(0, 0, 0, 0)") bg = bg.parentElement;
    const [a, b] = [lum(rgb(getComputedStyle(el).color)), lum(rgb(back))];
    done((Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05));
  },

  // `words` as marked tokens on one line and unmarked on the next, large (64 px: a
  // glyph's overhang is a few pixels at the page's size); `css` is added to the page
  // first.  Their rectangles [x, y, w, h].
  twoLines(words, css, done) {
    if (css) {
      const style = document.createElement("style");
      style.textContent = css;
      document.head.appendChild(style);
    }
    const out = document.getElementById("output");
    const line = (marked) => {
      const div = document.createElement("div");
      div.style.cssText = "display: inline-block; font-size: 64px";
      words.forEach((w, i) => {
        const s = document.createElement("span");
        s.className = "tok " + (i % 2 ? "target" : "draft");
        if (!marked) s.style.cssText = "background: none; text-decoration: none";
        s.textContent = w;
        div.appendChild(s);
      });
      out.appendChild(div);
      out.appendChild(document.createElement("br"));
      return div;
    };
    const rect = (el) => { const r = el.getBoundingClientRect();
      return [r.left, r.top, r.width, r.height].map(Math.round); };
    const a = line(true), b = line(false);
    done([rect(a), rect(b)]);
  },

  // Pixels of the unmarked line that are clearly lighter in the marked one: ink a
  // background painted over (a translucent background only darkens).
  inkLost(png, ra, rb, done) {
    const img = new Image();
    img.onload = () => {
      const c = document.createElement("canvas");
      c.width = img.width;
      c.height = img.height;
      const g = c.getContext("2d");
      g.drawImage(img, 0, 0);
      const lum = (r) => {
        const d = g.getImageData(r[0], r[1], r[2], r[3]).data, out = [];
        for (let i = 0; i < d.length; i += 4) out.push(0.2126 * d[i] + 0.7152 * d[i + 1] + 0.0722 * d[i + 2]);
        return out;
      };
      const a = lum(ra), b = lum(rb);
      let lost = 0;
      for (let i = 0; i < b.length; i++) if (a[i] - b[i] > 30) lost++;
      done(lost);
    };
    img.src = "data:image/png;base64," + png;
  },

  // window.runStart: Generate clicked; window.runDone: the status says done
  timeRun(done) {
    window.runStart = window.runDone = undefined;
    document.getElementById("generate").addEventListener("click", () => { window.runStart = performance.now(); },
                                                        { capture: true, once: true });
    const status = document.getElementById("status");
    const watch = new MutationObserver(() => {
      if (status.dataset.state === "done" && window.runDone === undefined) {
        window.runDone = performance.now();
        watch.disconnect();
      }
    });
    watch.observe(status, { attributes: true, childList: true, characterData: true, subtree: true });
    done(true);
  },
};
