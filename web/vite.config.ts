import { defineConfig } from "vite";

// The build goes into the Python package, which serves it (perfsleuth ui).
export default defineConfig({
  base: "./",
  build: {
    outDir: "../src/perfsleuth/server/static",
    emptyOutDir: true,
    chunkSizeWarningLimit: 600,
  },
  server: { proxy: { "/api": "http://127.0.0.1:8321" } },
});
