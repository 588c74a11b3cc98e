// The model's Markdown, as DOM nodes: fenced code blocks, headings, lists, paragraphs; `code`, **bold**,
// *emphasis* and [links](https://...) inside them. Every piece of the model's text becomes a text node
// (createTextNode, textContent), never HTML: "<script>" or "<img onerror=...>" in a reply shows as those
// characters and runs nothing. A link keeps its target only when it is http(s): no javascript: URL.
"use strict";

const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|\*(?=[^\s*])([^*]*?[^\s*])\*|\[([^\]\n]+)\]\(([^)\s]+)\)/;

function appendInline(parent, text) {
  while (text) {
    const m = INLINE.exec(text);
    if (!m) {
      parent.appendChild(document.createTextNode(text));
      return;
    }
    if (m.index > 0) parent.appendChild(document.createTextNode(text.slice(0, m.index)));
    let node;
    if (m[1] !== undefined) {
      node = document.createElement("code");
      node.textContent = m[2];
    } else if (m[3] !== undefined) {
      node = document.createElement("strong");
      appendInline(node, m[3]);
    } else if (m[4] !== undefined) {
      node = document.createElement("em");
      appendInline(node, m[4]);
    } else if (/^https?:\/\//i.test(m[6])) {
      node = document.createElement("a");
      node.href = m[6];
      node.rel = "noopener noreferrer nofollow";
      node.target = "_blank";
      node.textContent = m[5];
    } else {
      node = document.createTextNode(m[0]); // a link to anything else stays the text it was
    }
    parent.appendChild(node);
    text = text.slice(m.index + m[0].length);
  }
}

const FENCE = /^ {0,3}(```+|~~~+)\s*([\w+#.-]*)\s*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const ITEM = /^ {0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;

// Renders `text` into `container`, replacing what it held. A fence still open (a reply streaming in, or cut
// off) runs to the end of the text.
function renderMarkdown(container, text) {
  container.replaceChildren();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const code = [];
      for (i += 1; i < lines.length && !lines[i].trim().startsWith(fence[1]); i += 1) code.push(lines[i]);
      i += 1; // the closing fence
      const pre = document.createElement("pre");
      const codeNode = document.createElement("code");
      if (fence[2]) codeNode.dataset.lang = fence[2];
      codeNode.textContent = code.join("\n");
      pre.appendChild(codeNode);
      container.appendChild(pre);
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const node = document.createElement(`h${Math.min(heading[1].length + 2, 6)}`); // h3..h6: a reply's scale
      appendInline(node, heading[2]);
      container.appendChild(node);
      i += 1;
      continue;
    }
    if (ITEM.test(line)) {
      const ordered = /\d/.test(ITEM.exec(line)[1]);
      const list = document.createElement(ordered ? "ol" : "ul");
      for (let m; i < lines.length && (m = ITEM.exec(lines[i])) && /\d/.test(m[1]) === ordered; i += 1) {
        const item = document.createElement("li");
        appendInline(item, m[2]);
        list.appendChild(item);
      }
      container.appendChild(list);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const paragraph = [];
    for (; i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i])
         && !ITEM.test(lines[i]); i += 1) paragraph.push(lines[i]);
    const node = document.createElement("p");
    appendInline(node, paragraph.join("\n")); // its line breaks are kept by CSS (white-space: pre-wrap)
    container.appendChild(node);
  }
}
