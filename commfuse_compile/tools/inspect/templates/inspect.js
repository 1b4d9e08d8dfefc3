(function () {
  var input = document.getElementById("site-filter");
  var count = document.getElementById("site-count");
  var rows = Array.prototype.slice.call(document.querySelectorAll("#sites tbody tr"));
  function filter() {
    var words = input.value.toLowerCase().split(/\s+/).filter(Boolean);
    var shown = 0;
    rows.forEach(function (row) {
      var text = row.textContent.toLowerCase();
      row.hidden = !words.every(function (w) { return text.indexOf(w) >= 0; });
      if (!row.hidden) shown += 1;
    });
    count.textContent = shown + " of " + rows.length + " sites shown";
  }
  function openLinkedGraph() {
    var target = document.getElementById(location.hash.slice(1));
    if (target && target.tagName === "DETAILS") target.open = true;
  }
  input.addEventListener("input", filter);
  window.addEventListener("hashchange", openLinkedGraph);
  filter();
  openLinkedGraph();
})();
