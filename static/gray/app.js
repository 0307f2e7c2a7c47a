document.title += " (gray app.js)";
