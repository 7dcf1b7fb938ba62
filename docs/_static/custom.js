// gradaccum_jax docs: a table wider than its column becomes one card per row (custom.css), each
// cell labelled with its column's header, so that no column is hidden past the page's edge.
function stackWideTables() {
  for (const table of document.querySelectorAll("table.table")) {
    const headers = [...table.querySelectorAll("thead th")].map((th) => th.textContent.trim());
    if (headers.length < 2) continue;
    for (const row of table.querySelectorAll("tbody tr")) {
      [...row.children].forEach((cell, i) => cell.setAttribute("data-label", headers[i] ?? ""));
    }
    table.classList.remove("stacked");
    const box = table.parentElement;
    if (table.scrollWidth > box.clientWidth + 1) table.classList.add("stacked");
  }
}
document.addEventListener("DOMContentLoaded", stackWideTables);
let resizeTimer;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(stackWideTables, 100);
});
