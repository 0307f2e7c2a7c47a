document.title += " (formal app.js)";
