// gradaccum_jax docs (see custom.css).

// On a phone's screen, a table much wider than its column becomes one card per row, each cell
// labelled with its column's header; a table a little too wide gets a smaller font if that
// makes it fit, and otherwise becomes cards too: on a phone no table scrolls sideways with its
// columns cut off. On a wider screen every table stays a table: a smaller font if that makes it
// fit, else it scrolls sideways.
const PHONE_WIDTH = 720;
const STACK_WHEN_WIDER_THAN = 1.3; // the table's width over its column's
const SMALLER_FONT = "0.8em";
// A cell this short (a number, "yes", "0.15 (0.70)") stays on one line on a wide screen, and
// on a phone too if it is one word ("2.5e-07" never breaks at its hyphen): long cells wrap.
const SHORT_CELL = 12;

function stackWideTables() {
  for (const table of document.querySelectorAll("table.table")) {
    const headers = [...table.querySelectorAll("thead th")].map((th) => th.textContent.trim());
    if (headers.length < 2) continue;
    for (const row of table.querySelectorAll("tbody tr")) {
      [...row.children].forEach((cell, i) => {
        cell.setAttribute("data-label", headers[i] ?? "");
        const text = cell.textContent.trim();
        cell.classList.toggle("short", text.length <= SHORT_CELL);
        cell.classList.toggle("short-word", text.length <= SHORT_CELL && !/\s/.test(text));
      });
    }
    table.classList.remove("stacked");
    table.style.fontSize = "";
    const box = table.parentElement;
    const phone = window.innerWidth <= PHONE_WIDTH;
    const ratio = table.scrollWidth / box.clientWidth;
    if (phone && ratio > STACK_WHEN_WIDER_THAN) {
      table.classList.add("stacked");
    } else if (ratio > 1) {
      // A little too wide: a smaller font, if that makes it fit; else cards on a phone, and
      // sideways scrolling on a wider screen.
      table.style.fontSize = SMALLER_FONT;
      if (table.scrollWidth > box.clientWidth) {
        table.style.fontSize = "";
        if (phone) table.classList.add("stacked");
      }
    }
  }
}

// A long token of inline code (shorter in a table's cell, any in its header) may break after a
// dot before a name, a slash, an equals sign or a comma (an empty <wbr> element), never inside
// a name.
const LONG_TOKEN = 24;
const LONG_TOKEN_IN_TABLE = 16;

function breakLongTokens() {
  for (const span of document.querySelectorAll("code.literal span.pre")) {
    const text = span.textContent;
    const cell = span.closest("th, td"); // in a table, as narrow as it can be
    const limit = cell === null ? LONG_TOKEN : cell.tagName === "TH" ? 0 : LONG_TOKEN_IN_TABLE;
    if (text.length <= limit || span.children.length) continue;
    // Not inside "..." or 0.10, nor before a file's extension (test_x.py).
    const parts = text.split(/(?<=\.)(?![a-z]{1,5}(?:[,)]|$))(?=[A-Za-z_])|(?<=[/=,])(?=.)/);
    if (parts.length < 2) continue;
    span.textContent = "";
    span.classList.add("breakable");
    parts.forEach((part, i) => {
      if (i) span.appendChild(document.createElement("wbr"));
      span.appendChild(document.createTextNode(part));
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  breakLongTokens();
  stackWideTables();
});
let resizeTimer;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(stackWideTables, 100);
});
